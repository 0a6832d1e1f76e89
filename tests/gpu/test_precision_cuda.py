"""The CUDA twin of tests/model/test_precision_policy.py (issue 26): under CUDA bf16 autocast, both residual
streams run every matmul but the router's on bf16 inputs (the unembedding included; SDPA and the grouped
experts too), and their carrier is fp32. Run by tools/gpu_check/gpu_check.sh; without a CUDA device the same check runs
on the CPU stand-in (CPU bf16 autocast under CUDA's rules) with NAG's compiled regions, as `auto` picks on CUDA."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from nagmoe.cuda_rules.tier import CudaAutocastRules

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model"))
import test_precision_policy as cpu  # noqa: E402  (the CPU test's recorder and table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu_check/gpu_check.sh)")
@pytest.mark.parametrize("residual", ["prenorm", "nag"])
def test_every_matmul_but_the_routers_takes_bf16_inputs_on_cuda(residual):
    cpu.check_uniform_table(cpu.bf16_step(cpu.model_for(residual, "uniform", device="cuda"), device="cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the CUDA test runs instead")
@pytest.mark.parametrize("residual", ["prenorm", "nag"])
def test_every_matmul_but_the_routers_takes_bf16_inputs_on_the_cpu_stand_in(residual):
    """The recorder is a TorchDispatchMode: under torch >= 2.12 NAG's fullgraph regions raised "found no compiled
    frames" under it (issue 52 item 7); they run eagerly there now, so the recorder sees the modulator's linear."""
    model = cpu.model_for(residual, "uniform", "model.nag.impl=compiled")
    with CudaAutocastRules("2.11"):
        cpu.check_uniform_table(cpu.bf16_step(model))
