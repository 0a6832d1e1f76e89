"""CUDA's autocast policy, op by op, one table per target torch version (written out, not read from torch).

CUDA's autocast (aten/src/ATen/autocast_mode.cpp, `TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)`) puts every op it
casts under one of six policies; an op on no list runs on whatever dtypes it is given:
  LOWER     lower_precision_fp: floating args (not fp64) cast to the autocast dtype (bf16): matmuls, convs.
  FP32      fp32: floating args cast to fp32. `square` decomposes to `pow`, which is here: ReLU² comes back fp32.
  FP32_OPT  fp32_set_opt_dtype: when the first arg is floating and no `dtype` is given, `dtype=float32`
            (sum, softmax, cumsum, ...): a bf16 `sum` comes back fp32 on CUDA (CPU autocast leaves it bf16).
  FP32_APP  fp32_append_dtype: the overload with a trailing `dtype` is called with float32 (norm).
  PROMOTE   promote: floating args cast to the widest among them (fp32 wins over bf16; fp64 args ignored).
  BANNED    banned: raises (binary_cross_entropy: unsafe under autocast; use the _with_logits form).

The tables differ between torch versions: `rms_norm` joined the fp32 list in torch 2.12 (not in 2.11, which the
GPU machine runs). A version is chosen by name (`rules_for("2.11")`); tests/cuda_rules keep each table honest
against the installed torch's `AutocastCUDA` registrations and against real CUDA autocast on fake CUDA tensors.
"""
from __future__ import annotations

from nagmoe.base.errors import UserError

LOWER, FP32, FP32_OPT, FP32_APP, PROMOTE, BANNED = "lower", "fp32", "fp32_opt_dtype", "fp32_append_dtype", \
    "promote", "banned"

_LOWER_OPS = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
)
_FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
_FP32_OPT_OPS = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# fp32_append_dtype: the op -> the overload that takes a trailing dtype
APPEND_DTYPE_OVERLOAD = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
_PROMOTE_OPS = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)
_BANNED_OPS = ("binary_cross_entropy",)


def _base_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for ops, policy in ((_LOWER_OPS, LOWER), (_FP32_OPS, FP32), (_FP32_OPT_OPS, FP32_OPT),
                        (tuple(APPEND_DTYPE_OVERLOAD), FP32_APP), (_PROMOTE_OPS, PROMOTE), (_BANNED_OPS, BANNED)):
        for op in ops:
            table[op] = policy
    return table


# Per-version deltas against the torch 2.11 table (the GPU machine's torch): op -> policy, or None = removed.
VERSION_DELTAS: dict[str, dict[str, object]] = {
    "2.11": {},
    "2.12": {"rms_norm": FP32},
    "2.13": {"rms_norm": FP32},
}
KNOWN_VERSIONS = tuple(VERSION_DELTAS)


def version_key(version: str) -> str:
    """'2.13.0+cpu' -> '2.13' (the tables are per minor version)."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def rules_for(version: str) -> dict[str, str]:
    """{'aten op name[.overload]': policy} of CUDA's autocast in torch `version` ('2.11', '2.13.0', ...)."""
    key = version_key(str(version))
    if key not in VERSION_DELTAS:
        raise UserError(f"CUDA autocast rules: torch version {str(version)[:20]!r} has no table "
                        f"(known: {', '.join(KNOWN_VERSIONS)})")
    table = _base_table()
    for op, policy in VERSION_DELTAS[key].items():
        if policy is None:
            table.pop(op, None)
        else:
            table[op] = policy
    return table
