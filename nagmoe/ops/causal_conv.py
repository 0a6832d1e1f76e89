"""CCA's two causal convolutions over time as shifts and an einsum, in the (B, T, C) layout (issue 60, item 4).

Legend: B batch, T output tokens, L = T + k - 1 input tokens (history + chunk), C channels, G groups
(heads), O = I = C / G channels of one group out and in, k kernel width.

A valid (unpadded) conv of kernel k over the left-padded input x_BLC, with PyTorch's Conv1d weight layout
(C, C / groups, k) and bias (C,), is, for output token t (input token t + k - 1 is the newest it sees):

    depthwise (groups = C):   y[t, c]    = b[c]    + sum_{j<k} w[c, 0, j] · x[t + j, c]
    grouped (G groups):       y[t, g, o] = b[g, o] + sum_{j<k} sum_i W[g, o, i, j] · x[t + j, g, i]

The depthwise conv is k shifted multiply-adds (one fused element-wise loop under the compiler). The grouped
one is an einsum over the I in-channels of each group that gives every tap's product for every input token,
z[l, g, o, j] = sum_i W[g, o, i, j] · x[l, g, i] (a batched GEMM per group, N = O·k), then the shift-sum
y[t] = b + sum_j z[t + j, j] (another fused loop). Nothing is transposed to (B, C, T) and back, which is what the
cuDNN/depthwise kernels of nn.Conv1d need around them on CUDA (nagmoe/model/cca.py chooses: this path inside
the compiled graph, the Conv1d ops in eager mode, so the CPU eager numbers do not move). What the backward
keeps is what the conv path keeps: the padded input and the depthwise output (shifting before the GEMM, by
stacking k shifted copies of its input, would keep k copies instead).

The maths is the conv's; the summation order is not (the conv kernels reduce over (i, j) in their own order),
so the two agree to fp32 rounding (~1e-7 relative), not bitwise.

Autocast: nn.Conv1d runs in the autocast dtype (bf16) and returns it. Here each shift-sum accumulates in the
promoted dtype (fp32 under autocast: the fp32 weights and biases, inside the fused loop, never stored) and is
cast to the dtype the conv would return; the einsum is autocast's bmm (bf16 in, bf16 out).
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
    """Conv1d(C, C, k, groups=G) of the (B, L, C) input, no padding: (B, L - k + 1, C). One einsum over the
    in-channels of each group gives every tap's product for every input token, z[b,l,g,o,j] =
    sum_i W[g,o,i,j] x[b,l,g,i] (a batched GEMM per group, N = O·k); the shift-sum y[t] = b + sum_j z[t + j, j]
    follows (one fused loop). Shifting after the GEMM keeps the GEMM's input the (B, L, C) tensor itself, the
    one the backward needs anyway, rather than k stacked shifted copies of it."""
    B, L, C = x_BLC.shape
    k = weight_COk.shape[-1]
    T = L - k + 1
    G = groups
    dtype = conv_dtype(x_BLC, weight_COk)
    w_GOIk = weight_COk.view(G, C // G, C // G, k)
    z_BLGOk = torch.einsum("blgi,goik->blgok", x_BLC.view(B, L, G, C // G).to(dtype), w_GOIk.to(dtype))
    acc = torch.promote_types(dtype, bias_C.dtype)  # fp32 under autocast: the taps summed before rounding
    y_BTGO = bias_C.to(acc).view(G, C // G) + z_BLGOk[:, :T, ..., 0].to(acc)
    for j in range(1, k):
        y_BTGO = y_BTGO + z_BLGOk[:, j:j + T, ..., j].to(acc)
    # one explicit copy into (B, T, C): the sum's layout follows z's (groups outermost), and with size-1 dims the
    # tracer's fake tensors and the real kernels can disagree on it (a decoding step, T = 1), so a traced
    # `reshape` could become a view that fails at run time; the compiler fuses the copy into the sum
    return y_BTGO.to(dtype).clone(memory_format=torch.contiguous_format).view(B, T, C)
