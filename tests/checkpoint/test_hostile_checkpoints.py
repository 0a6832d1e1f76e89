"""Hostile checkpoints stay inert (issue 21, point 1): every attack shape on DCP's `.metadata` — dotted names
through module globals, a module object, BUILD on a module or a class, SETITEM into builtins, an allowed class
given hostile arguments — is refused by the exact allow-list with one line naming the file and the refused
name, by every command that reads a checkpoint, and nothing runs. The payloads are shown to be real: the
stock unpickler runs each of them (in a throw-away process)."""
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from nagmoe.checkpoint import load_checkpoint, save_checkpoint
from nagmoe.checkpoint.safe_dcp import UnsafeCheckpoint
import hostile_payloads
from hostile_payloads import PAYLOADS, write_payload
from cli_process import ENV, REPO

SUPPORT = os.path.dirname(os.path.abspath(hostile_payloads.__file__))  # hostile_payloads and hostile_commands


def tiny_checkpoint(run_dir: str) -> tuple[str, torch.nn.Module]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return save_checkpoint(run_dir, 1, model, opt), model


STOCK_CHECK = """
import builtins, json, os, pickle, sys, time
import torch.distributed.checkpoint.filesystem, torch.distributed.checkpoint.metadata  # imported before any damage
sys.path.insert(0, {here!r})
from hostile_payloads import PAYLOADS, inject, payloads
metadata, work = sys.argv[1:]
with open(metadata, "rb") as f:
    original = f.read()
open_before, effects = builtins.open, {{}}
for name in PAYLOADS[:-1]:  # the last is data only (a storage path), nothing to run
    marker = os.path.join(work, name)
    result = pickle.loads(inject(original, payloads(marker)[name][0]))
    open_changed, sep_changed = builtins.open is not open_before, os.sep == "X"
    sep_changed = sep_changed or vars(torch.distributed.checkpoint.metadata.Metadata)["__init__"] is None
    builtins.open, os.sep = open_before, "/"  # undo the damage before using either
    for _ in range(50):  # os.popen runs its command in the background
        if os.path.exists(marker) or open_changed or sep_changed:
            break
        time.sleep(0.1)
    effects[name] = [type(result).__name__, os.path.exists(marker) or open_changed or sep_changed]
print(json.dumps(effects))
"""


def test_the_stock_unpickler_runs_every_payload(tmp_path):
    """Control: each payload does what it claims under `pickle.loads` (runs its command, replaces os.sep,
    builtins.open or a class attribute), and the metadata still loads — in a throw-away process."""
    checkpoint, _ = tiny_checkpoint(str(tmp_path / "run"))
    r = subprocess.run([sys.executable, "-c", STOCK_CHECK.format(here=SUPPORT), os.path.join(checkpoint, ".metadata"),
                        str(tmp_path)], capture_output=True, text=True, env=ENV, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    effects = json.loads(r.stdout)
    assert effects == {name: ["Metadata", True] for name in PAYLOADS[:-1]}


@pytest.mark.parametrize("name", PAYLOADS)
def test_every_payload_is_refused_in_one_line_and_nothing_runs(name, tmp_path):
    checkpoint, model = tiny_checkpoint(str(tmp_path / "run"))
    marker = str(tmp_path / "PWNED")
    refused = write_payload(checkpoint, name, marker)
    with pytest.raises(UnsafeCheckpoint) as info:
        load_checkpoint(checkpoint, model, restore_rng=False)
    message = str(info.value)
    assert "\n" not in message and os.path.join(checkpoint, ".metadata") in message and refused in message
    assert not os.path.exists(marker) and os.sep == "/"


def test_the_allow_list_is_exact():
    """A dotted name is refused even when it would end at an allowed object; so is an undotted module name,
    a function of an allowed module, and a builtin."""
    from nagmoe.checkpoint.safe_dcp import MetadataUnpickler, restricted_loads

    for module, name in [("torch", "Size.__mro__"), ("torch.distributed.checkpoint.metadata", "Metadata.__init__"),
                         ("torch.distributed.checkpoint.filesystem", "os"), ("torch", "load"),
                         ("builtins", "getattr"), ("torch.serialization", "load"), ("collections", "namedtuple")]:
        with pytest.raises(UnsafeCheckpoint):
            MetadataUnpickler.find_class(MetadataUnpickler.__new__(MetadataUnpickler), module, name)
    assert restricted_loads(pickle.dumps(torch.Size([2, 3]), protocol=4)) == torch.Size([2, 3])
    assert restricted_loads(pickle.dumps(torch.bfloat16, protocol=4)) is torch.bfloat16
    assert restricted_loads(pickle.dumps(torch.strided, protocol=4)) is torch.strided
    # the one function on the list (layout lookup by name) returns only torch layouts
    hostile_layout = pickle.dumps(torch.strided, protocol=4).replace(b"\x8c\rtorch.strided", b"\x8c\rbuiltins.exec")
    with pytest.raises(UnsafeCheckpoint, match="layout"):
        restricted_loads(hostile_layout)


# ----------------------------------------------------------------------------------------------------------
# Every command that reads a checkpoint, every payload: one subprocess per command, the payloads in-process
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "eval", "generate", "consolidate", "analyze", "report"])
def test_every_command_refuses_every_payload(command, trained_run, tmp_path):
    out = str(tmp_path / "results.json")
    r = subprocess.run([sys.executable, os.path.join(SUPPORT, "hostile_commands.py"), command, trained_run,
                        str(tmp_path / "work"), out], capture_output=True, text=True, env=ENV, cwd=REPO,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(out) as f:
        results = json.load(f)
    assert sorted(results) == sorted(PAYLOADS)
    for name, got in results.items():
        assert not got["marker"] and not got["process_changed"], (name, got)
        if command == "report":  # renders the rest; the unreadable run is one problem line per reading
            assert got["rc"] == 0 and "Traceback" not in got["stderr"], (name, got["stderr"][-2000:])
            assert got["problems"] and all("\n" not in p for p in got["problems"]), (name, got["problems"])
            assert any(got["metadata"] in p and got["refused"] in p for p in got["problems"]), (name, got)
            continue
        lines = got["stderr"].strip().splitlines()
        assert got["rc"] == 2, (name, got)
        assert len(lines) == 1 and "Traceback" not in got["stderr"], (name, got["stderr"])
        assert got["metadata"] in lines[0] and got["refused"] in lines[0], (name, lines[0])
        assert not got["marker"] and not got["process_changed"], (name, got)
