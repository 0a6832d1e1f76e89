"""ReLU², the activation of every FFN and expert MLP, in the dtype of its input on every device.

    relu2(h) = r · r,  r = relu(h)

Written as a product, not `relu(h).square()`: `square` decomposes to `pow`, which CUDA's autocast runs in fp32.
A bf16 `h` then comes back fp32 on CUDA, so the next grouped GEMM meets fp32 x bf16 and fails (`_grouped_mm`,
`grouped_gemm` are bf16 only), and `pow` saves an fp32 copy of r for its backward: S x H x 4 bytes per MoE layer
(131,072 slots x 2048 hidden = 1 GiB at the paper's micro-batch). `mul` is on no autocast list: r · r stays in
h's dtype, and autograd saves the one tensor r (relu's output, shared by mul's two operands).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def relu_squared(h: torch.Tensor) -> torch.Tensor:
    r = F.relu(h)
    return r * r
