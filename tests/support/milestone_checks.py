"""What the milestone tests (tests/checkpoint/test_milestone.py, tests/parallel/test_ep_milestone.py) check of a
weights-only milestone on disk and read back."""
import torch
from torch.distributed.checkpoint import FileSystemReader

from nagmoe.checkpoint import load_model_weights
from nagmoe.checkpoint.milestone import low_precision_keys
from nagmoe.model import build_model


def stored_dtypes(path):
    """{DCP key: dtype} as the files hold them (None for a non-tensor item)."""
    entries = FileSystemReader(path).read_metadata().state_dict_metadata.items()
    return {k: getattr(getattr(v, "properties", None), "dtype", None) for k, v in entries}


def assert_milestone_is_checkpoint_cast_by_role(cfg, milestone, checkpoint):
    """The milestone read into the fp32 model equals the full checkpoint of its step, bf16-rounded for the cast
    roles and exact everywhere else."""
    from_milestone, from_checkpoint = build_model(cfg.model), build_model(cfg.model)
    step = load_model_weights(milestone, from_milestone)["step"]
    assert step == load_model_weights(checkpoint, from_checkpoint)["step"]
    low = low_precision_keys(from_milestone)
    got, want = from_milestone.state_dict(), from_checkpoint.state_dict()
    assert got.keys() == want.keys() and low
    for key, t in want.items():
        expected = t.to(torch.bfloat16).to(t.dtype) if key in low else t
        assert got[key].dtype == t.dtype and torch.equal(got[key], expected), key
    assert any(not torch.equal(got[k], want[k]) for k in low)  # the bf16 rounding is there (the check can fail)
