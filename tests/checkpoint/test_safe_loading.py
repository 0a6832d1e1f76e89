"""Safe loading (issue 16, item 4): the manifest is verified before anything is unpickled; DCP's .metadata
and non-tensor items are read without executing pickled code; every torch.load in the package uses
weights_only=True (DeepSpeed's files too, through our checkpoint engine: tests/deepspeed)."""
import ast
import glob
import os
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nagmoe.base.errors import UserError
from nagmoe.checkpoint import latest_valid_checkpoint, load_checkpoint
from nagmoe.checkpoint.safe_dcp import UnsafeCheckpoint, safe_dcp_load
from hostile_payloads import rewrite_manifest
from cli_process import REPO


class Payload:
    """Unpickling this creates `marker` (a harmless stand-in for arbitrary code: `open` is called)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def checkpoint_copy(trained_run, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(os.path.join(trained_run, "run"), run_dir)
    from nagmoe.model import build_model
    from nagmoe.rundir.info import read_saved_config

    cfg = read_saved_config(run_dir)
    return latest_valid_checkpoint(run_dir), build_model(cfg.model)


def test_real_checkpoint_loads_through_the_safe_path(checkpoint_copy):
    checkpoint, model = checkpoint_copy
    before = {k: v.clone() for k, v in model.state_dict().items()}
    load_checkpoint(checkpoint, model, restore_rng=False)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_manifest_is_checked_before_the_metadata_is_unpickled(checkpoint_copy, tmp_path):
    checkpoint, model = checkpoint_copy
    marker = str(tmp_path / "pwned")
    with open(os.path.join(checkpoint, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)
    with pytest.raises(UserError, match="bytes|sha256"):
        load_checkpoint(checkpoint, model, restore_rng=False)
    assert not os.path.exists(marker)


def test_malicious_metadata_with_a_matching_manifest_is_refused(checkpoint_copy, tmp_path):
    checkpoint, model = checkpoint_copy
    marker = str(tmp_path / "pwned")
    with open(os.path.join(checkpoint, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)
    rewrite_manifest(checkpoint, ".metadata")
    with pytest.raises(UnsafeCheckpoint, match="names .*open"):
        load_checkpoint(checkpoint, model, restore_rng=False)
    assert not os.path.exists(marker)


def test_malicious_non_tensor_item_is_refused(tmp_path):
    """DCP stores non-tensor values as pickled bytes; torch's default planner loads them with
    weights_only=False (shown: the payload runs), ours with weights_only=True (refused)."""
    path = str(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "extra": Payload(str(tmp_path / "default"))}, checkpoint_id=path,
                 no_dist=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(2), "extra": None}, checkpoint_id=path, no_dist=True)
    assert os.path.exists(tmp_path / "default")  # the danger is real with the stock loader
    os.remove(tmp_path / "default")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsafeCheckpoint, match="extra"):
            safe_dcp_load({"w": torch.zeros(2), "extra": None}, path, no_dist=True)
    assert not os.path.exists(tmp_path / "default")


def test_malicious_consolidated_file_is_refused(tmp_path):
    from nagmoe.checkpoint.consolidate import load_consolidated

    marker = str(tmp_path / "pwned")
    path = str(tmp_path / "consolidated.pt")
    torch.save({"format": "nagmoe-consolidated", "version": 1, "model": Payload(marker)}, path)
    with pytest.raises(UserError, match="not a readable consolidated checkpoint"):
        load_consolidated(path)
    assert not os.path.exists(marker)


def torch_load_calls():
    """(file, line, has weights_only=True) for every torch.load(...) call in the package."""
    for path in glob.glob(os.path.join(REPO, "nagmoe", "**", "*.py"), recursive=True):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                yield os.path.relpath(path, REPO), node.lineno, safe


def test_every_torch_load_uses_weights_only():
    calls = list(torch_load_calls())
    assert calls, "the scan found no torch.load at all: it is broken"
    unsafe = [(f, line) for f, line, safe in calls if not safe]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"
