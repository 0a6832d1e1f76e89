"""`nagmoe import-hf` bounded by what the config and the weights' header say (issue 53 items 1-5): a hostile or
oversized export is one line, exit 2, nothing in OUT, under a 2 GiB address-space limit — never a MemoryError
traceback, an allocation of a model the weights do not describe, or the OOM killer."""
import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nagmoe.cli import main

LIMIT = 2 << 30  # the address space of the child that imports (torch itself maps ~1 GiB of it)

# One child imports every case (a process start costs ~5 s): the CLI's own handling, any escaping exception
# recorded as what it is (a traceback would be the bug).
CHILD = r"""
import contextlib, io, json, resource, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
from nagmoe.cli import main
results = []
for src, out in json.loads(sys.argv[2]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = main(["import-hf", src, "--run-dir", out])
    except BaseException as e:
        rc, err = "escaped", io.StringIO(traceback.format_exc()[-1500:])
    results.append({"rc": rc, "err": err.getvalue()})
print(json.dumps(results))
"""


def _copy(out, tmp_path, name):
    d = tmp_path / name
    shutil.copytree(out, d)
    return d


def _header_of(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"]) for k, v in header.items()}


def write_sparse_safetensors(path, entries):
    """A self-consistent safetensors file of `entries` {name: (dtype, shape)} whose data is a hole: the header
    matches the file's size, and the file takes no disk (a 4 GiB tensor costs nothing here)."""
    size = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "BOOL": 1, "I64": 8}
    header, at = {}, 0
    for name, (dtype, shape) in entries.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + at)


def _huge_tensor(d):
    """Item 1: the embedding as a 4 GiB tensor (512 x 2**21 fp32), the header matching the file."""
    entries = _header_of(d / "model.safetensors")
    entries["model.wte.weight"] = ("F32", [512, 1 << 21])
    write_sparse_safetensors(d / "model.safetensors", entries)


def _config(change):
    def edit(d):
        c = json.load(open(d / "config.json"))
        change(c)
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _huge_tokenizer(d):
    """Item 3: a 3 GiB tokenizer.json (sparse)."""
    with open(d / "tokenizer.json", "r+b") as f:
        f.truncate(3 << 30)


def _consistent_but_too_big(d):
    """A config and a header that agree on a model of ~3.3 GiB (width 4096): more than the process can hold."""
    from nagmoe.config import config_from_dict
    from nagmoe.model import build_model

    c = json.load(open(d / "config.json"))
    c["nagmoe_model"]["d_model"] = 4096
    c["nagmoe_model"]["moe"]["expert_hidden"] = 4096
    (d / "config.json").write_text(json.dumps(c))
    cfg = config_from_dict({"model": c["nagmoe_model"], "data": {"seq_len": c["seq_len"]}})
    names = {torch.float32: "F32", torch.float64: "F64", torch.bool: "BOOL"}
    write_sparse_safetensors(d / "model.safetensors", {"model." + k: (names[t.dtype], list(t.shape))
                                                       for k, t in build_model(cfg.model, device="meta").state_dict().items()})


CASES = {  # name: (edit, what the one line must say)
    "huge_tensor": (_huge_tensor, "'model.wte.weight' has shape (512, 2097152), the config's model (512, 32)"),
    "too_big_config": (_config(lambda c: c["nagmoe_model"].update(d_model=65536)),
                       "parameters (config.json and the weights do not belong together: "),
    "huge_tokenizer": (_huge_tokenizer, "3,221,225,472 bytes is too large for a tokenizer.json"),
    "consistent_but_too_big": (_consistent_but_too_big, "GiB of memory, this process has"),
}


def test_oversized_exports_are_one_line_under_a_2_gib_address_space(exported_run, tmp_path):
    _, out = exported_run
    jobs = []
    for name, (edit, _) in CASES.items():
        d = _copy(out, tmp_path, name)
        edit(d)
        jobs.append((str(d), str(tmp_path / f"run_{name}")))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, str(LIMIT), json.dumps(jobs)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    for (name, (_, needle)), (_, run_dir), got in zip(CASES.items(), jobs, results):
        err = got["err"].strip()
        assert got["rc"] == 2, (name, err[-1500:])
        assert err.count("\n") == 0 and "Traceback" not in err and needle in err and len(err) < 600, (name, err)
        assert not os.path.exists(run_dir), name  # nothing in OUT


def test_an_integer_tensor_is_refused_naming_it(exported_run, tmp_path, capsys):
    """Item 5: an int64 where a weight belongs is not cast to fp32 silently."""
    _, out = exported_run
    d = _copy(out, tmp_path, "int64")
    t = load_file(str(d / "model.safetensors"))
    t["model.wte.weight"] = torch.zeros(t["model.wte.weight"].shape, dtype=torch.int64)
    save_file(t, str(d / "model.safetensors"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # an existing empty OUT stays empty
    assert main(["import-hf", str(d), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'model.wte.weight' has dtype I64" in err, err
    assert os.listdir(run_dir) == []


def test_bf16_weights_and_the_mod_buffers_dtypes_are_accepted(exported_run, tmp_path):
    """What an export legitimately holds: bf16 matrices (`--dtype bfloat16`), and MoD's float64/bool buffers."""
    _, out = exported_run
    d = _copy(out, tmp_path, "bf16")
    t = load_file(str(d / "model.safetensors"))
    assert t["model.stream.mod.histogram"].dtype == torch.float64 and t["model.stream.mod.skipping"].dtype == torch.bool
    t["model.wte.weight"] = t["model.wte.weight"].to(torch.bfloat16)
    save_file(t, str(d / "model.safetensors"))
    assert main(["import-hf", str(d), "--run-dir", str(tmp_path / "run")]) == 0


def test_a_megabyte_config_key_shows_a_few_hundred_characters(exported_run, tmp_path, capsys):
    """Item 4: the unknown key goes through errors.shown, not the whole 1 MB into the line."""
    _, out = exported_run
    d = _copy(out, tmp_path, "long_key")
    _config(lambda c: c["nagmoe_model"].update({"k" * 1_000_000: 1}))(d)
    assert main(["import-hf", str(d), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown config key 'model.kkkk" in err and len(err) < 600, len(err)


@pytest.mark.parametrize("header", [b"\xff" * 8, struct.pack("<Q", 40) + b"[" * 40,
                                    struct.pack("<Q", 2) + b"{}"])
def test_a_malformed_header_is_one_line(exported_run, tmp_path, capsys, header):
    _, out = exported_run
    d = _copy(out, tmp_path, "bad_header")
    (d / "model.safetensors").write_bytes(header)
    assert main(["import-hf", str(d), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.safetensors" in err and len(err) < 600, err


def test_every_file_of_an_export_has_the_directorys_mode(exported_run):
    """Item 9: one mode rule (the directory's, without execute): model.safetensors is not 0600 among 0644s."""
    _, out = exported_run
    want = os.stat(out).st_mode & 0o666
    modes = {name: os.stat(os.path.join(out, name)).st_mode & 0o777 for name in os.listdir(out)}
    assert modes and all(m == want for m in modes.values()), (oct(want), {k: oct(v) for k, v in modes.items()})
