"""CCA's two causal convolutions over time as shifts and an einsum, in the (B, T, C) layout (issue 60, item 4).

Legend: B batch, T output tokens, L = T + k - 1 input tokens (history + chunk), C channels, G groups
(heads), O = I = C / G channels of one group out and in, k kernel width.

A valid (unpadded) conv of kernel k over the left-padded input x_BLC, with PyTorch's Conv1d weight layout
(C, C / groups, k) and bias (C,), is, for output token t (input token t + k - 1 is the newest it sees):

    depthwise (groups = C):   y[t, c]    = b[c]    + sum_{j<k} w[c, 0, j] · x[t + j, c]
    grouped (G groups):       y[t, g, o] = b[g, o] + sum_{j<k} sum_i W[g, o, i, j] · x[t + j, g, i]

The depthwise conv is k shifted multiply-adds (one fused element-wise loop under the compiler); the grouped
one is one einsum over the k stacked shifts and the I in-channels of each group (a batched GEMM per group,
contraction I·k). Nothing is transposed to (B, C, T) and back, which is what the cuDNN/depthwise kernels of
nn.Conv1d need around them on CUDA (nagmoe/model/cca.py chooses: this path inside the compiled graph, the
Conv1d ops in eager mode, so the CPU eager numbers do not move).

The maths is the conv's; the summation order is not (the conv kernels reduce over (i, j) in their own
order), so the two agree to fp32 rounding (~1e-7 relative), not bitwise.

Autocast: nn.Conv1d runs in the autocast dtype (bf16) and returns it. Here the depthwise sum accumulates in
the promoted dtype of input and weight (fp32 under autocast, fused, so never stored) and is cast to the dtype
the conv would return; the einsum is autocast's bmm (bf16 in, bf16 out), the bias added in that dtype.
"""
from __future__ import annotations

import torch


def conv_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype nn.Conv1d would return for input `x` and `weight` here: autocast's where it is on."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(x.dtype, weight.dtype)


def depthwise_causal_conv(x_BLC: torch.Tensor, weight_C1k: torch.Tensor, bias_C: torch.Tensor) -> torch.Tensor:
    """Conv1d(C, C, k, groups=C) of the (B, L, C) input, no padding: (B, L - k + 1, C)."""
    k = weight_C1k.shape[-1]
    T = x_BLC.shape[1] - k + 1
    w_kC = weight_C1k[:, 0, :].t()
    y_BTC = bias_C + w_kC[0] * x_BLC[:, :T]
    for j in range(1, k):  # k is 1-3: unrolled in the graph, one fused loop
        y_BTC = y_BTC + w_kC[j] * x_BLC[:, j:j + T]
    return y_BTC.to(conv_dtype(x_BLC, weight_C1k))


def grouped_causal_conv(x_BLC: torch.Tensor, weight_COk: torch.Tensor, bias_C: torch.Tensor,
                        groups: int) -> torch.Tensor:
    """Conv1d(C, C, k, groups=G) of the (B, L, C) input, no padding: (B, L - k + 1, C). The k shifted windows
    stacked on a last axis, then y[b,t,g,o] = sum_{i,j} x[b,t+j,g,i] W[g,o,i,j] in one einsum."""
    B, L, C = x_BLC.shape
    k = weight_COk.shape[-1]
    T = L - k + 1
    G = groups
    dtype = conv_dtype(x_BLC, weight_COk)
    x_BTCk = torch.stack([x_BLC[:, j:j + T] for j in range(k)], dim=-1)
    w_GOIk = weight_COk.view(G, C // G, C // G, k)
    y_BTGO = torch.einsum("btgik,goik->btgo", x_BTCk.view(B, T, G, C // G, k).to(dtype), w_GOIk.to(dtype))
    return y_BTGO.reshape(B, T, C) + bias_C.to(dtype)
