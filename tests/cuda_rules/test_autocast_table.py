"""The CUDA autocast tables stay honest (issue 38): against the installed torch's AutocastCUDA registrations,
and op by op against real CUDA autocast run on fake CUDA tensors (a CPU-only torch can do that)."""
import json
import subprocess
import sys

import pytest
import torch

from nagmoe.cuda_rules.probe import sample_ops
from nagmoe.cuda_rules.table import KNOWN_VERSIONS, VERSION_DELTAS, rules_for, version_key
from nagmoe.base.errors import UserError

INSTALLED = version_key(torch.__version__)
# Ops whose sample cannot run on fake CUDA tensors here (no meta kernel for a CUDA-only kernel, or a fake-device
# check): their policy is checked by tools/gpu_check/gpu_check.sh's probe on a real GPU. The test fails when one starts
# working, so this list only shrinks.
UNPROBED_ON_FAKE_CUDA = {"grid_sampler", "gru_cell", "_thnn_fused_gru_cell", "cudnn_convolution",
                         "cudnn_convolution_transpose"}


def test_installed_torch_has_a_table():
    assert INSTALLED in KNOWN_VERSIONS, f"add a table delta for torch {INSTALLED} (nagmoe/cuda_rules/table.py)"


def test_table_is_exactly_the_installed_autocast_cuda_registrations():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
                  if n.startswith("aten::")}
    table = set(rules_for(torch.__version__))
    assert sorted(registered - table) == [], "CUDA autocast casts ops the table does not know"
    assert sorted(table - registered) == [], "the table lists ops CUDA autocast does not cast in this torch"


def test_versions_differ_only_by_their_explicit_deltas():
    assert "rms_norm" not in rules_for("2.11")  # the GPU machine's torch: rms_norm not on a list
    for v in ("2.12", "2.13.0+cpu"):
        assert rules_for(v)["rms_norm"] == "fp32"
    for v in KNOWN_VERSIONS:
        diff = set(rules_for(v).items()) ^ set(rules_for("2.11").items())
        assert {op for op, _ in diff} <= set(VERSION_DELTAS[v])
    with pytest.raises(UserError, match="no table"):
        rules_for("1.13")


def test_samples_call_every_op_of_the_table():
    all_ops = set().union(*(rules_for(v) for v in KNOWN_VERSIONS))
    assert sample_ops() == all_ops


@pytest.mark.slow
def test_tier_returns_what_real_cuda_autocast_returns_op_by_op():
    code = ("import json; from nagmoe.cuda_rules.probe import probe; "
            f"print(json.dumps([probe('cuda-fake'), probe('tier', {INSTALLED!r})]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cuda, tier = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(cuda) == set(tier)
    unprobed = {k for k, v in cuda.items() if set(v.values()) == {"error"} and k != "binary_cross_entropy"}
    assert unprobed == UNPROBED_ON_FAKE_CUDA
    assert set(cuda["binary_cross_entropy"].values()) == {"error"} == set(tier["binary_cross_entropy"].values())
    diffs = {k: (cuda[k], tier[k]) for k in cuda if k not in unprobed and cuda[k] != tier[k]}
    assert diffs == {}
    # the rules that matter to us, as CUDA itself returns them
    assert cuda["pow.Tensor_Scalar"]["low"] == "float32" and cuda["sum.dim_IntList"]["low"] == "float32"
    assert cuda["sum.dim_IntList+dtype"]["low"] == "bfloat16" and cuda["mm"]["fp32"] == "bfloat16"
    assert cuda["addcmul"]["mixed"] == "float32" and cuda["addcmul"]["low"] == "bfloat16"
