"""Per-op dtype probe: what each op of the autocast tables returns under autocast, for three input variants.

    python -m nagmoe.cuda_rules.probe --mode cuda-fake            # real CUDA autocast, fake CUDA tensors
    python -m nagmoe.cuda_rules.probe --mode tier --rules 2.13   # CPU autocast + nagmoe's CUDA rules, fake CPU
    python -m nagmoe.cuda_rules.probe --mode cuda                # on a GPU: the ground truth for a table
    python -m nagmoe.cuda_rules.probe --mode tier --rules 2.11 --compare bench.json   # a GPU's dump vs the tier

Prints JSON {sample: {variant: "bfloat16,float32" | "error"}}; with --compare FILE (such a dump, or the bench.json of
tools/gpu_check/gpu_check.sh, whose env section holds the GPU's), the samples where the two differ, and exit 1 if any do. Variants: every floating input bf16 (`low`),
fp32 (`fp32`), or alternating bf16/fp32 (`mixed`, which tells `promote` from the others). Fake tensors have no
data, so this runs on a CPU-only torch; it runs under no_grad (FakeTensorMode with autograd on CUDA fake tensors
aborts the process). A sample's name is its aten op; `name+suffix` adds a case (an explicit `dtype`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch

VARIANTS = ("low", "fp32", "mixed")


class _Maker:
    """Makes the inputs of one sample: floats by variant (alternating for `mixed`), long zeros for indices."""

    def __init__(self, device: str, variant: str):
        self.device, self.variant, self.n = device, variant, 0

    def __call__(self, *shape) -> torch.Tensor:
        self.n += 1
        low = self.variant == "low" or (self.variant == "mixed" and self.n % 2 == 1)
        return torch.empty(shape, dtype=torch.bfloat16 if low else torch.float32, device=self.device)

    def i(self, *shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.long, device=self.device)


def _samples(T) -> dict:
    """sample name -> (aten overload name, args, kwargs). Shapes are small and valid for each op."""
    c2 = lambda: (T(1, 2, 5, 5), T(3, 2, 3, 3))  # noqa: E731
    s = {
        "_convolution": ("_convolution", (*c2(), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True,
                                          True), {}),
        "_convolution.deprecated": ("_convolution.deprecated", (*c2(), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                                False, False, True), {}),
        "conv1d": ("conv1d", (T(1, 2, 5), T(3, 2, 3)), {}),
        "conv2d": ("conv2d", c2(), {}),
        "conv3d": ("conv3d", (T(1, 2, 4, 4, 4), T(3, 2, 2, 2, 2)), {}),
        "conv_tbc": ("conv_tbc", (T(5, 1, 2), T(3, 2, 3), T(3), 0), {}),
        "conv_transpose1d": ("conv_transpose1d", (T(1, 2, 5), T(2, 3, 3)), {}),
        "conv_transpose2d.input": ("conv_transpose2d.input", (T(1, 2, 5, 5), T(2, 3, 3, 3)), {}),
        "conv_transpose3d.input": ("conv_transpose3d.input", (T(1, 2, 4, 4, 4), T(2, 3, 2, 2, 2)), {}),
        "convolution": ("convolution", (*c2(), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}),
        "prelu": ("prelu", (T(2, 3), T(3)), {}),
        "addmm": ("addmm", (T(2, 3), T(2, 4), T(4, 3)), {}),
        "addmv": ("addmv", (T(2), T(2, 4), T(4)), {}),
        "addr": ("addr", (T(2, 3), T(2), T(3)), {}),
        "matmul": ("matmul", (T(2, 4), T(4, 3)), {}),
        "einsum": ("einsum", ("ij,jk->ik", [T(2, 4), T(4, 3)]), {}),
        "mm": ("mm", (T(2, 4), T(4, 3)), {}),
        "mv": ("mv", (T(2, 4), T(4)), {}),
        "linalg_vecdot": ("linalg_vecdot", (T(2, 4), T(2, 4)), {}),
        "linear": ("linear", (T(2, 4), T(3, 4)), {}),
        "addbmm": ("addbmm", (T(2, 3), T(2, 2, 4), T(2, 4, 3)), {}),
        "baddbmm": ("baddbmm", (T(2, 2, 3), T(2, 2, 4), T(2, 4, 3)), {}),
        "bmm": ("bmm", (T(2, 2, 4), T(2, 4, 3)), {}),
        "chain_matmul": ("chain_matmul", ([T(2, 4), T(4, 3), T(3, 2)],), {}),
        "linalg_multi_dot": ("linalg_multi_dot", ([T(2, 4), T(4, 3), T(3, 2)],), {}),
        "_thnn_fused_lstm_cell": ("_thnn_fused_lstm_cell", (T(2, 12), T(2, 12), T(2, 3), T(12), T(12)), {}),
        "_thnn_fused_gru_cell": ("_thnn_fused_gru_cell", (T(2, 9), T(2, 9), T(2, 3), T(9), T(9)), {}),
        "lstm_cell": ("lstm_cell", (T(2, 4), [T(2, 3), T(2, 3)], T(12, 4), T(12, 3), T(12), T(12)), {}),
        "gru_cell": ("gru_cell", (T(2, 4), T(2, 3), T(9, 4), T(9, 3), T(9), T(9)), {}),
        "rnn_tanh_cell": ("rnn_tanh_cell", (T(2, 4), T(2, 3), T(3, 4), T(3, 3), T(3), T(3)), {}),
        "rnn_relu_cell": ("rnn_relu_cell", (T(2, 4), T(2, 3), T(3, 4), T(3, 3), T(3), T(3)), {}),
        "_scaled_dot_product_flash_attention": ("_scaled_dot_product_flash_attention",
                                                (T(1, 2, 4, 8), T(1, 2, 4, 8), T(1, 2, 4, 8)), {}),
        "scaled_dot_product_attention": ("scaled_dot_product_attention", (T(1, 2, 4, 8), T(1, 2, 4, 8),
                                                                          T(1, 2, 4, 8)), {}),
        "cudnn_convolution": ("cudnn_convolution", (*c2(), [0, 0], [1, 1], [1, 1], 1, False, False, True), {}),
        "cudnn_convolution_transpose": ("cudnn_convolution_transpose", (T(1, 2, 5, 5), T(2, 3, 3, 3), [0, 0],
                                                                        [0, 0], [1, 1], [1, 1], 1, False, False,
                                                                        True), {}),
        "pow.Tensor_Scalar": ("pow.Tensor_Scalar", (T(4), 2), {}),
        "pow.Tensor_Tensor": ("pow.Tensor_Tensor", (T(4), T(4)), {}),
        "pow.Scalar": ("pow.Scalar", (2.0, T(4)), {}),
        "softplus": ("softplus", (T(4),), {}),
        "layer_norm": ("layer_norm", (T(2, 4), [4], T(4), T(4)), {}),
        "native_layer_norm": ("native_layer_norm", (T(2, 4), [4], T(4), T(4), 1e-5), {}),
        "group_norm": ("group_norm", (T(2, 4, 3), 2, T(4), T(4)), {}),
        "frobenius_norm.dim": ("frobenius_norm.dim", (T(2, 4), [1]), {}),
        "nuclear_norm": ("nuclear_norm", (T(3, 3),), {}),
        "nuclear_norm.dim": ("nuclear_norm.dim", (T(2, 3, 3), [1, 2]), {}),
        "cosine_similarity": ("cosine_similarity", (T(2, 4), T(2, 4)), {}),
        "poisson_nll_loss": ("poisson_nll_loss", (T(4), T(4), True, False, 1e-8, 1), {}),
        "cosine_embedding_loss": ("cosine_embedding_loss", (T(2, 4), T(2, 4), T(2)), {}),
        "nll_loss": ("nll_loss", (T(2, 5), T.i(2)), {}),
        "nll_loss2d": ("nll_loss2d", (T(2, 5, 3, 3), T.i(2, 3, 3)), {}),
        "multilabel_margin_loss": ("multilabel_margin_loss", (T(2, 4), T.i(2, 4)), {}),
        "triplet_margin_loss": ("triplet_margin_loss", (T(2, 4), T(2, 4), T(2, 4)), {}),
        "multi_margin_loss": ("multi_margin_loss", (T(2, 4), T.i(2)), {}),
        "margin_ranking_loss": ("margin_ranking_loss", (T(4), T(4), T(4)), {}),
        "pdist": ("pdist", (T(3, 4),), {}),
        "cdist": ("cdist", (T(3, 4), T(2, 4)), {}),
        "renorm": ("renorm", (T(3, 4), 2, 0, 1.0), {}),
        "logsumexp": ("logsumexp", (T(2, 4), [1]), {}),
        "rms_norm": ("rms_norm", (T(2, 4), [4], T(4)), {}),
        "prod": ("prod", (T(4),), {}),
        "prod.dim_int": ("prod.dim_int", (T(2, 4), 1), {}),
        "softmax.int": ("softmax.int", (T(2, 4), 1), {}),
        "softmax.int+dtype": ("softmax.int", (T(2, 4), 1, torch.bfloat16), {}),
        "log_softmax.int": ("log_softmax.int", (T(2, 4), 1), {}),
        "cumprod": ("cumprod", (T(4), 0), {}),
        "cumsum": ("cumsum", (T(4), 0), {}),
        "linalg_vector_norm": ("linalg_vector_norm", (T(4),), {}),
        "linalg_matrix_norm": ("linalg_matrix_norm", (T(3, 3), 1), {}),
        "linalg_matrix_norm.str_ord": ("linalg_matrix_norm.str_ord", (T(3, 3),), {}),
        "sum": ("sum", (T(4),), {}),
        "sum+dtype": ("sum", (T(4),), {"dtype": torch.bfloat16}),
        "sum.dim_IntList": ("sum.dim_IntList", (T(2, 4), [1]), {}),
        "sum.dim_IntList+dtype": ("sum.dim_IntList", (T(2, 4), [1]), {"dtype": torch.bfloat16}),
        "norm.Scalar": ("norm.Scalar", (T(4), 2), {}),
        "norm.ScalarOpt_dim": ("norm.ScalarOpt_dim", (T(2, 4), 2, [1]), {}),
        "addcdiv": ("addcdiv", (T(4), T(4), T(4)), {}),
        "addcmul": ("addcmul", (T(4), T(4), T(4)), {}),
        "atan2": ("atan2", (T(4), T(4)), {}),
        "bilinear": ("bilinear", (T(2, 3), T(2, 4), T(5, 3, 4), T(5)), {}),
        "cross": ("cross", (T(2, 3), T(2, 3)), {}),
        "dot": ("dot", (T(4), T(4)), {}),
        "vdot": ("vdot", (T(4), T(4)), {}),
        "grid_sampler": ("grid_sampler", (T(1, 2, 4, 4), T(1, 3, 3, 2), 0, 0, False), {}),
        "index_put": ("index_put", (T(4), [T.i(2)], T(2)), {}),
        "tensordot": ("tensordot", (T(2, 3), T(3, 2), [1], [0]), {}),
        "scatter_add": ("scatter_add", (T(2, 4), 1, T.i(2, 4), T(2, 4)), {}),
        "binary_cross_entropy": ("binary_cross_entropy", (T(4), T(4)), {}),
    }
    for name in ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
                 "rsqrt", "sinh", "tan"):
        s[name] = (name, (T(4),), {})
    for name in ("hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
                 "soft_margin_loss", "binary_cross_entropy_with_logits", "dist"):
        s[name] = (name, (T(4), T(4)), {})
    for name, shape, size in (("1d", (1, 2, 4), [8]), ("2d", (1, 2, 4, 4), [8, 8]), ("3d", (1, 2, 2, 2, 2), [4, 4, 4])):
        s[f"upsample_nearest{name}"] = (f"upsample_nearest{name}", (T(*shape), size), {})
        s[f"_upsample_nearest_exact{name}"] = (f"_upsample_nearest_exact{name}", (T(*shape), size), {})
    for name, shape, size in (("upsample_linear1d", (1, 2, 4), [8]), ("upsample_bilinear2d", (1, 2, 4, 4), [8, 8]),
                              ("_upsample_bilinear2d_aa", (1, 2, 4, 4), [8, 8]),
                              ("upsample_trilinear3d", (1, 2, 2, 2, 2), [4, 4, 4]),
                              ("upsample_bicubic2d", (1, 2, 4, 4), [8, 8]),
                              ("_upsample_bicubic2d_aa", (1, 2, 4, 4), [8, 8])):
        s[name] = (name, (T(*shape), size, False), {})
    return s


def sample_ops() -> set[str]:
    """The aten ops the samples call (for the coverage test)."""
    return {op for op, _, _ in _samples(_Maker("meta", "low")).values()}


def _overload(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _dtypes(out) -> str:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return ",".join(str(o.dtype).split(".")[-1] for o in outs if isinstance(o, torch.Tensor))


def probe(mode: str, rules: str | None = None) -> dict:
    """{sample: {variant: output dtypes | 'error'}} under `mode` (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = "cpu" if mode == "tier" else "cuda"
    fake = mode in ("tier", "cuda-fake")
    results: dict = {}
    names = list(_samples(_Maker("meta", "low")))
    if mode == "tier":
        from nagmoe.cuda_rules.tier import cuda_rules_autocast
        region = lambda: cuda_rules_autocast(rules)  # noqa: E731
    else:
        region = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    results = {name: {} for name in names}
    for variant in VARIANTS:  # the samples' inputs made once per variant (not per op: 366 times as many tensors)
        with torch.no_grad(), (FakeTensorMode() if fake else contextlib.nullcontext()):
            samples = _samples(_Maker(device, variant))
            for name in names:
                op_name, args, kwargs = samples[name]
                try:
                    with _cuda_autocast_raw() if mode == "cuda-fake" else region():
                        results[name][variant] = _dtypes(_overload(op_name)(*args, **kwargs))
                except Exception:  # an op this device cannot run, or a banned op: compared as such
                    results[name][variant] = "error"
    return {name: {v: results[name][v] for v in VARIANTS} for name in names}


@contextlib.contextmanager
def _cuda_autocast_raw():
    """CUDA autocast switched on below `torch.autocast` (whose checks need a CUDA device) for fake tensors."""
    prev_on, prev_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", prev_on)
        torch.set_autocast_dtype("cuda", prev_dtype)
        torch.clear_autocast_cache()


def read_dump(path: str) -> dict:
    """A probe dump from `path`: the dump itself, or the GPU's inside a tools/gpu_check/gpu_check.sh bench.json."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "sections" in data:
        data = (((data["sections"].get("env") or {}).get("result") or {}).get("autocast") or {}).get("dtype_probe")
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{path}: no probe dump (a bench.json without a GPU's env section?)")
    return data


def disagreements(reference: dict, other: dict) -> dict:
    """{sample: {"reference": ..., "other": ...}} where the two dumps differ (a sample either lacks counts)."""
    return {k: {"reference": reference.get(k), "other": other.get(k)}
            for k in sorted(set(reference) | set(other)) if reference.get(k) != other.get(k)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="per-op dtypes under autocast (nagmoe.cuda_rules)")
    ap.add_argument("--mode", choices=("cuda-fake", "tier", "cuda"), required=True)
    ap.add_argument("--rules", default=None, help="torch version of the tier's table (mode tier)")
    ap.add_argument("--compare", default=None, metavar="FILE", help="a dump (or bench.json) to compare with")
    args = ap.parse_args(argv)
    if args.mode == "tier" and not args.rules:
        ap.error("--mode tier needs --rules VERSION")
    reference = None
    if args.compare:
        try:
            reference = read_dump(args.compare)
        except (OSError, ValueError) as e:
            print(f"probe: {str(e)[:300]}", file=sys.stderr)
            return 2
    result = probe(args.mode, args.rules)
    if reference is None:
        json.dump(result, sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    diff = disagreements(reference, result)
    json.dump({"compared": len(reference), "disagree": diff}, sys.stdout, indent=1, sort_keys=True)
    print()
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
