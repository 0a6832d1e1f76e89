"""nagmoe's CPU stand-in for CUDA's autocast rules of torch 2.11 (`NAGMOE_CUDA_RULES=2.11`, nagmoe/cuda_rules/tier.py
and table.py) against the ground truth: the per-op dtypes the real CUDA autocast of torch 2.11.0+cu130 gave on an
NVIDIA H200 (`probe --mode cuda`, tools/gpu_check/gpu_check.sh's env section, Python 3.12.3, 2026-12-04; fixture
fixtures/h200-torch-2.11-dtype-probe.json). Every sample the CPU can run agrees, in all three input variants; the
3 that differ are ops with no CPU kernel at all (cuDNN convolutions, the fused GRU cell), which the stand-in reports
as errors and nagmoe does not use."""
import json
import os

from nagmoe.cuda_rules.probe import disagreements, probe, read_dump

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "h200-torch-2.11-dtype-probe.json")
NO_CPU_KERNEL = {"_thnn_fused_gru_cell", "cudnn_convolution", "cudnn_convolution_transpose"}


def test_the_2_11_tier_gives_the_h200s_dtypes_wherever_the_cpu_has_the_op():
    real = read_dump(FIXTURE)
    tier = probe("tier", "2.11")
    assert set(real) == set(tier), sorted(set(real) ^ set(tier))  # the same samples
    diff = disagreements(real, tier)
    assert set(diff) == NO_CPU_KERNEL, json.dumps(diff, indent=1)[:3000]
    assert all(set(tier[k].values()) == {"error"} for k in NO_CPU_KERNEL)
    assert real["mm"] == {"fp32": "bfloat16", "low": "bfloat16", "mixed": "bfloat16"}  # a cast-to-low op
    assert real["softmax.int"]["low"] == "float32"  # a cast-to-fp32 op
