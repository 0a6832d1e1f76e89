"""Where a training step's time and kernel launches go, by region (issue 60): one `Trainer.train_step` under
torch.profiler, each host op and the device time of its kernels attributed to

    attention   the attention sublayers (CCA or MHA), forward and backward
    moe_gemm    the MoE's grouped GEMMs (`aten::_grouped_mm`, forward and backward)
    moe_glue    the rest of the MoE sublayers: routing, the slot sort and gathers, ReLU², the combine
    ffn         a dense MLP sublayer (configs without MoE)
    loss        the decode and the chunked cross-entropy, forward, recompute and backward
    optimizer   `Optimizer.step` of every optimizer (Muon, AdamW)
    stream      everything else inside the forward and backward: the embedding, the residual stream's
                own ops (NAG's modulator and update, pre-norm's norm and add)
    other       the rest of the step: gradient clipping, the metrics read, zero_grad, the data

A region's forward is a `record_function` span opened by this tool (module hooks around each sublayer, a
wrapper around the loss function): nothing in the model changes. Its backward is each autograd node the
forward's ops created, found by sequence number (what the profiler's own forward/backward links use; the
mod_speed section reads its shares from this table), its whole `evaluate_function` time.

Per region: time (device time of the kernels on CUDA, host CPU time on the CPU) and **launches**: aten ops
that call no other aten op (what reaches a kernel: `aten::linear` -> `aten::mm` counts once; `_grouped_mm`
counts once, not the per-expert `mm`s the CPU runs inside it; with `train.compile` on the CPU, inductor's fused C++
kernels count too, one launch per call, seen through `torch._inductor.config.cpp.enable_kernel_profile`). On CUDA
also the GPU's idle time within the step (its wall time minus the union of the kernels' intervals) and the grouped
GEMM's achieved FLOP/s (FLOPs from the recorded shapes: 2 m k n per call, forward and backward).

Across the regions (issue 69, item 3): `in_graph`, the launches inside a compiled graph's call (aot_autograd's
`CompiledFunction` forward or backward), so `launches - in_graph` is what ran eagerly between the compiled units;
and with `--mod-select` (Python stacks recorded) `mod_select`, the eager launches of MoD's per-sublayer selection:
ops under the calibrator's `select` / `record` or a static `Selection`'s decision (`SELECTION_FRAMES`), i.e. the
mask, the counts and the histogram update when they run outside a compiled graph.

    python tools/bench/step_profile.py configs/paper/nag-r40.yaml [--set key=value ...] [--warm 1] [--json out.json]
        [--mod-select]

The CPU comparison of docs/benchmarks.md (issue 60): the same command on the parent commit's checkout and on
this one, at reduced width (`--set model.d_model=128 ...`), eager.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile

# tools/gpu_check/ (beside this folder): gpu_check_mod's sublayer spans, gpu_check_train's synthetic shards
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu_check"))

from gpu_check_mod import BACKWARD, SublayerRegions, _inside, _spans  # noqa: E402  (the forward/backward linking rule)

PREFIX = "step_profile."
REGIONS = ("attention", "moe_gemm", "moe_glue", "ffn", "loss", "optimizer", "stream", "other")
GROUPED_MM = "aten::_grouped_mm"
PYTHON_FRAME = re.compile(r"\.py\(\d+\): ")
GRAPH_CALLS = ("CompiledFunction", "CompiledFunctionBackward")  # aot_autograd's runtime call of a compiled graph
# MoD's per-sublayer selection, as Python frames (the profiler's `with_stack` events): the calibrator's select and
# its counts (mod_calibration.py), a static Selection's decision and gather's ExecutedTokens (mod.py)
SELECTION_FRAMES = re.compile(r"mod_calibration\.py\(\d+\): (select|_select_static|_add_scores|record)$"
                              r"|/mod\.py\(\d+\): (__init__|resolve|static_decision|_true_rows|mask_BT|counts_1P)$")


def sublayer_region(module) -> str:
    name = type(module).__name__
    if "Attention" in name:
        return "attention"
    return "moe" if name == "MoELayer" else "ffn"


class Regions(SublayerRegions):
    """The tool's `record_function` spans: around every sublayer call (gpu_check_mod's forward hooks, named by
    role) and around the loss (the module-level loss function of nagmoe.model.transformer, wrapped for the
    profiled step only)."""

    def __init__(self, model):
        from torch.profiler import record_function

        import nagmoe.model.transformer as transformer

        super().__init__(model, name_of=lambda sub: PREFIX + sublayer_region(sub))
        self.transformer, self.loss_fn = transformer, getattr(transformer, "chunked_loss", None)
        if self.loss_fn is not None:
            inner = self.loss_fn

            def loss(*args, **kwargs):
                with record_function(PREFIX + "loss"):
                    return inner(*args, **kwargs)

            transformer.chunked_loss = loss

    def close(self):
        super().close()
        if self.loss_fn is not None:
            self.transformer.chunked_loss = self.loss_fn


def _is_leaf_aten(e) -> bool:
    return e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children)


def _is_inductor_kernel(e) -> bool:
    """A fused C++ kernel of a CPU inductor graph (named `graph_N_cpp_fused_...` under enable_kernel_profile)."""
    return "cpp_fused_" in e.name


def _is_python(e) -> bool:
    """A Python function's event (`with_stack`): `file.py(line): name` or `<built-in ...>`; not an op."""
    return PYTHON_FRAME.search(e.name) is not None or e.name.startswith("<built-in")


def _has_ancestor(e, test) -> bool:
    parent = e.cpu_parent
    while parent is not None:
        if test(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def _in_graph(e) -> bool:
    return _has_ancestor(e, lambda name: name in GRAPH_CALLS)


def selection_frame(e):
    """The function of MoD's selection (`SELECTION_FRAMES`) that event `e` runs under, or None."""
    parent = e.cpu_parent
    while parent is not None:
        found = SELECTION_FRAMES.search(parent.name)
        if found:
            return found.group(1) or found.group(2)
        parent = parent.cpu_parent
    return None


def grouped_mm_flops(shapes) -> float:
    """2 m k n of one `_grouped_mm` call from its operand shapes: (m, k) x (E, k, n) (the forward and the input
    gradient) or (k, m) x (m, n) grouped along m (the weight gradient: an (E, k, n) result)."""
    mats = [s for s in shapes or () if len(s) in (2, 3)][:2]
    if len(mats) < 2:
        return 0.0
    a, b = mats
    if len(a) == 2 and len(b) == 3:
        return 2.0 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2.0 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 3:
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    return 0.0


def _union_seconds(intervals) -> float:
    """Seconds covered by the union of (start, end) intervals in microseconds."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e6


def region_table(events, cuda: bool, wall_s: float | None = None) -> dict:
    """Per region {"s": time, "launches": leaf aten ops} for one profiled step's events (module docstring),
    the step's totals, the GPU idle time (CUDA) and the grouped GEMM's FLOP/s."""
    from torch.autograd import DeviceType

    host = [e for e in events if e.device_type == DeviceType.CPU and not _is_python(e)]
    spans, optim = _spans(host, PREFIX), _spans(host, "Optimizer.step")

    def busy(e, self_only):
        if cuda:
            return e.self_device_time_total if self_only else e.device_time_total
        return e.self_cpu_time_total if self_only else e.cpu_time_total

    forward_kind, node_kind = {}, {}
    for e in host:
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD) and not e.name.startswith(PREFIX):
            kind = _inside(spans, e)
            if kind is not None:
                node_kind.setdefault((e.thread, e.sequence_nr), kind)
    backward_spans = {}
    for e in host:
        if e.name.startswith(BACKWARD) and e.sequence_nr >= 0:
            kind = node_kind.get((getattr(e, "fwd_thread", e.thread), e.sequence_nr))
            if kind is not None:
                backward_spans.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end, kind))
    backward_spans = {t: sorted(v) for t, v in backward_spans.items()}
    in_step = _spans(host, "autograd::engine::evaluate_function")  # any backward node: 'stream' if unclaimed
    forward = _spans(host, "step_profile:model")

    table = {r: {"s": 0.0, "launches": 0} for r in REGIONS}
    in_graph, mod_select = 0, 0
    gemm_flops, gemm_s = 0.0, 0.0
    for e in host:
        if e.name.startswith(PREFIX) or e.name.startswith("autograd::engine") or e.name.startswith("Optimizer."):
            continue
        kind = _inside(spans, e) or _inside(backward_spans, e)
        if kind is None:
            if _inside(optim, e) is not None:
                kind = "optimizer"
            elif _inside(forward, e) is not None or _inside(in_step, e) is not None:
                kind = "stream"
            else:
                kind = "other"
        in_gemm = _inside_gemm(e)  # the CPU's `_grouped_mm` runs a `mm` per expert: one launch on a GPU
        if kind == "moe":
            kind = "moe_gemm" if e.name == GROUPED_MM or in_gemm else "moe_glue"
        table[kind]["s"] += busy(e, True) / 1e6
        if e.name == GROUPED_MM or (_is_leaf_aten(e) and not in_gemm) or _is_inductor_kernel(e):
            table[kind]["launches"] += 1
            in_graph += _in_graph(e)
            mod_select += selection_frame(e) is not None
        if e.name == GROUPED_MM:
            gemm_flops += grouped_mm_flops(e.input_shapes)
            gemm_s += busy(e, False) / 1e6
    total_s = sum(r["s"] for r in table.values())
    out = {"regions": table, "total_s": total_s, "launches": sum(r["launches"] for r in table.values()),
           "in_graph": in_graph, "mod_select": mod_select,
           "grouped_gemm_flops_per_s": gemm_flops / gemm_s if gemm_s > 0 else None, "grouped_gemm_s": gemm_s}
    if cuda:
        kernels = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        busy_s = _union_seconds(kernels)
        out["gpu_busy_s"] = busy_s
        out["gpu_idle_s"] = None if wall_s is None else max(0.0, wall_s - busy_s)
    return out


def _inside_gemm(e) -> bool:
    """An op the CPU's `_grouped_mm` runs inside itself (its per-expert `mm`s) counts as the GEMM."""
    parent = e.cpu_parent
    while parent is not None:
        if parent.name == GROUPED_MM:
            return True
        parent = parent.cpu_parent
    return False


@contextlib.contextmanager
def model_span(model):
    """A `step_profile:model` span around every forward of the model: unclaimed forward ops are the stream's."""
    from torch.profiler import record_function

    open_spans = []

    def enter(m, a):
        span = record_function("step_profile:model")
        span.__enter__()
        open_spans.append(span)

    def leave(m, a, o):
        open_spans.pop().__exit__(None, None, None)

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def profile_step(trainer, table_path: str | None = None, row_limit: int = 40, stacks: bool = False) -> dict:
    """One `trainer.train_step()` under torch.profiler (CUDA activity on a GPU): the region table, and the
    kernel table written to `table_path`. `stacks`: record Python stacks (the `mod_select` count; slower)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    regions = Regions(trainer.model)
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with model_span(trainer.model), profile(activities=activities, record_shapes=True, with_stack=stacks) as prof:
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        regions.close()
    if table_path:
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        with open(table_path, "w") as f:
            f.write(prof.key_averages().table(sort_by=sort, row_limit=row_limit) + "\n")
    return {"profiled_wall_s": wall, **region_table(prof.events(), cuda, wall)}


def format_table(result: dict) -> str:
    lines = ["| region | s | share | launches |", "|---|---|---|---|"]
    total = result["total_s"] or 1.0
    for name, r in result["regions"].items():
        lines.append(f"| {name} | {r['s']:.4f} | {r['s'] / total:.3f} | {r['launches']} |")
    lines.append(f"| total | {result['total_s']:.4f} | 1 | {result['launches']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key=value (repeatable)")
    ap.add_argument("--warm", type=int, default=1, help="steps before the profiled one")
    ap.add_argument("--data", default=None, help="a prepared data dir (default: a small script-made one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--table", default=None, help="write the kernel table here")
    ap.add_argument("--mod-select", action="store_true", help="count MoD's eager selection ops (Python stacks)")
    args = ap.parse_args(argv)

    import torch
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # train.compile on the CPU: its fused kernels are launches

    from nagmoe.config import load_config
    from nagmoe.train.trainer import Trainer

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = list(args.overrides)
        if args.data is None:
            from gpu_check_train import make_data

            cfg0 = load_config(args.config, overrides)
            made = make_data(os.path.join(tmp, "data"), cfg0.model.vocab_size, 1 << 17)
            overrides += [f"data.data_dir={made['data_dir']}", "data.verify_shards=false"]
        else:
            overrides.append(f"data.data_dir={args.data}")
        overrides += ["log.wandb=off", "train.eval_every=0", "train.checkpoint_every=0"]
        cfg = load_config(args.config, overrides)
        trainer = Trainer(cfg, os.path.join(tmp, "run"))
        try:
            for _ in range(args.warm):
                trainer.train_step()
            result = profile_step(trainer, args.table, stacks=args.mod_select)
        finally:
            trainer.release_lease()
    print(format_table(result))
    print(f"launches in compiled graphs {result['in_graph']}, eager {result['launches'] - result['in_graph']}"
          + (f"; MoD selection ops run eagerly {result['mod_select']}" if args.mod_select else ""))
    if result.get("grouped_gemm_flops_per_s"):
        print(f"grouped GEMM: {result['grouped_gemm_flops_per_s'] / 1e9:.1f} GFLOP/s "
              f"over {result['grouped_gemm_s']:.4f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
