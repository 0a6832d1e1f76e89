"""The CUDA twin of tests/model/test_precision_policy.py (issue 26): under CUDA bf16 autocast, both residual
streams run every matmul but the router's on bf16 inputs (the unembedding included; SDPA and the grouped
experts too), and their carrier is fp32. Run by tools/gpu_check.sh; skipped without a CUDA device."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model"))
import test_precision_policy as cpu  # noqa: E402  (the CPU test's recorder and table)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tools/gpu_check.sh)")]


@pytest.mark.parametrize("residual", ["prenorm", "nag"])
def test_every_matmul_but_the_routers_takes_bf16_inputs_on_cuda(residual):
    cpu.check_uniform_table(cpu.bf16_step(cpu.model_for(residual, "uniform", device="cuda"), device="cuda"))
