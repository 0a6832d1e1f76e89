"""A DCP `.metadata` written by the GPU machine's torch (2.11.0+cu130 on the H200, tools/gpu_check/gpu_check.sh's `dcp`
section, 2026-12-04) reads through the restricted unpickler of this torch: a checkpoint saved there loads here.
The fixture is a tiny model (configs/tiny.yaml, d_model 32, 1 layer, vocab 256) and its AdamW state."""
import os

import pytest

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "dcp-torch-2.11.0.metadata")


def test_torch_2_11_metadata_reads_under_the_allow_list():
    from nagmoe.checkpoint.safe_dcp import read_metadata_file

    metadata = read_metadata_file(FIXTURE)
    keys = set(metadata.state_dict_metadata)
    assert "model.wte.weight" in keys and any(k.startswith("optim.") or "exp_avg" in k for k in keys), sorted(keys)[:8]
    assert metadata.state_dict_metadata["model.wte.weight"].size == (256, 32)


def test_a_tampered_2_11_metadata_is_refused_in_one_line(tmp_path):
    from nagmoe.checkpoint.safe_dcp import read_metadata_file
    from nagmoe.base.errors import UserError

    data = open(FIXTURE, "rb").read()
    path = tmp_path / ".metadata"
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(UserError, match="unreadable checkpoint metadata") as e:
        read_metadata_file(str(path))
    assert "\n" not in str(e.value)
