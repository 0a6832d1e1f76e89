"""The profile section of tools/gpu_check/gpu_check.sh (issue 60): where the r40 step's time goes, at the paper's
tokens per optimizer step, before and after issue 60's changes, in one call.

The first GPU run put baseline-r40 and nag-r40 at MFU 0.14 against the H200's 989 TFLOP/s at 65,536 tokens a step.
Per config of CONFIGS, through the real `Trainer` (compiled as the training sections, whose inductor caches this
section reuses) at PAPER_TOKENS tokens per optimizer step (131,072 per GPU, the paper's: configs/paper/base.yaml),
and per variant of VARIANTS (`after`: today's defaults; `before`: the switches that restore the code before issue
60: Muon one matrix at a time (`train.muon_impl=loop`), the metrics read before the optimizer step, the eager loss
chunk recomputed in the backward, CCA's convolutions as nn.Conv1d in the compiled unit; `restore_before`):
  * WARM steps, then TIMED steps timed with CUDA events (perf_counter on the CPU): the step, each micro-step's
    forward + backward (gpu_check_mod.MicroSteps) and the optimizer's step apart (events around
    `trainer.optim.step`, the bundle's instance attribute for this section only);
  * MFU at these tokens per step (the matmul FLOP convention, nagmoe.flops) against the data sheet, beside the
    training section's figure at 65,536 tokens (`mfu_today`, read from bench.json when that section ran);
  * one step under torch.profiler: time and kernel launches by region (tools/bench/step_profile.py: attention units,
    MoE GEMMs, MoE glue, loss, optimizer, the stream, the rest; GPU idle), the grouped GEMM's achieved FLOP/s, and
    the kernel table in $RESULTS/profile_<config>_<variant>.txt.
A variant that would not fit what is left of the limit (1.2x the last one's seconds) is skipped and said so; the
results so far are in bench.json after each variant. A failed compile is recorded and the section runs eager in a
fresh process (gpu_check_train.with_eager_fallback).
"""
from __future__ import annotations

import os
import statistics
import time

from gpu_check_configs import PAPER, SIZES, paper_config
from gpu_check_common import load
from gpu_check_mod import MicroSteps
from gpu_check_train import (ahead_estimate, data_dir, device_info, fresh_dir, free_memory, memory_estimate, sync,
                             with_eager_fallback)
from step_profile import profile_step

CONFIGS = ("baseline", "nag")
PAPER_TOKENS = {"gpu": 131072, "cpu": SIZES["cpu"]["batch_tokens"]}  # CPU: the rehearsal at its training size
WARM = {"gpu": 3, "cpu": 1}
TIMED = {"gpu": 3, "cpu": 1}
# per variant: config overrides, then `restore_before` for the runtime switches (module docstring)
VARIANTS = {"after": [], "before": ["train.muon_impl=loop"]}


# what answers first: both configs as they now run, then NAG's before (the paper's model), then the baseline's
ORDER = (("baseline", "after"), ("nag", "after"), ("nag", "before"), ("baseline", "before"))


def restore_before(trainer) -> list[str]:
    """The switches of the code before issue 60 that are not config keys, set on a built trainer: the metrics read
    before the optimizer step, the eager loss chunk recomputed in the backward, CCA's nn.Conv1d path inside the
    compiled unit. Not switchable (bitwise the same maths, no switch kept): the MoE glue (the permutation's gathers,
    the weight casts once per write); the `before` profile has them as after. Returns what it set."""
    from nagmoe.ops.loss import chunk_cross_entropy

    trainer.metrics_read_after = False
    trainer.model.loss_chunk, trainer.model.loss_recompute = chunk_cross_entropy, True
    convs = 0
    for sub in trainer.model.sublayers():
        if hasattr(sub, "conv_impl"):
            sub.conv_impl, convs = "conv", convs + 1
    return ["metrics read before the step", "eager loss chunk, recomputed", f"CCA conv_impl=conv ({convs} layers)"]


class OptimizerTimer(MicroSteps):
    """Events (CUDA) or perf_counter (CPU) around each `trainer.optim.step(...)`: the optimizer's time apart (the
    marks and `take` of MicroSteps; the bundle's step wrapped as an instance attribute, arguments passed on: the
    device-guarded step's `ok=`)."""

    def __init__(self, trainer):
        import torch

        self.torch, self.cuda, self.marks = torch, trainer.device.type == "cuda", []
        self.bundle, inner = trainer.optim, trainer.optim.step

        def step(*args, **kwargs):
            pair = [self._mark(), None]
            inner(*args, **kwargs)
            pair[1] = self._mark()
            self.marks.append(pair)

        self.bundle.step = step

    def close(self) -> None:
        del self.bundle.step  # the class's method again


def measure(ctx, key: str, variant: str, cfg, run_dir: str, device, peak) -> dict:
    import torch

    from nagmoe.flops import flops_per_token
    from nagmoe.train.trainer import Trainer

    # CUDA: the committed estimate for the trainer's memory refusal or the loss's plan (as the training sections)
    ahead = ahead_estimate(memory_estimate(key, cfg, device), cfg, device) if device.type == "cuda" else None
    free_memory()
    trainer = Trainer(cfg, run_dir, eager_memory_estimate=ahead)
    cuda = device.type == "cuda"
    try:
        restored = restore_before(trainer) if variant == "before" else []
        for _ in range(WARM[ctx.mode]):
            trainer.train_step()
        sync(device)
        micro, optim = MicroSteps(trainer.model, device), OptimizerTimer(trainer)
        steps, micro_s, optim_s = [], [], []
        try:
            for _ in range(TIMED[ctx.mode]):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                trainer.train_step()
                if cuda:
                    end.record()
                    end.synchronize()
                steps.append(start.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - t0)
                micro_s += micro.take()
                optim_s += optim.take()
        finally:
            micro.close()
            optim.close()
        step_s = statistics.median(steps)
        bt, T = cfg.train.batch_tokens, cfg.data.seq_len
        fpt = flops_per_token(cfg.model, T, None, "matmul")
        achieved = fpt * bt / step_s
        out = {"batch_tokens": bt, "grad_accum": trainer.accum, "backends": trainer.backends, "restored": restored,
               "step_s": step_s, "step_s_all": steps, "micro_step_s": statistics.median(micro_s),
               "forward_backward_s": statistics.median(micro_s) * trainer.accum,
               "optimizer_s": statistics.median(optim_s) if optim_s else None, "tokens_per_s": bt / step_s,
               "achieved_flops_per_s": achieved, "mfu_vs_datasheet": achieved / peak if peak else None}
        path = os.path.join(ctx.out, f"profile_{key}_{variant}.txt")
        out.update(profile_step(trainer, path), profile=os.path.basename(path))
        if out.get("grouped_gemm_flops_per_s"):
            out["grouped_gemm_tflops"] = out["grouped_gemm_flops_per_s"] / 1e12
    finally:
        trainer.release_lease()
    return out


def section_profile(ctx) -> dict:
    import torch

    device, name, peak, warnings = device_info()
    ctx.note_machine(torch=torch.__version__, device=name, **({"warnings": warnings} if warnings else {}))
    sections = load(ctx.out)["sections"]
    result = {"device": name, "torch": torch.__version__, "datasheet_peak_flops": peak,
              "paper_tokens_per_step": PAPER_TOKENS[ctx.mode], "configs": {}}
    for key in CONFIGS:
        entry = result["configs"].setdefault(key, {"config": f"configs/paper/{PAPER[key]}.yaml"})
        today = ((sections.get(f"train_{key}") or {}).get("result") or {}).get("mfu_vs_datasheet")
        entry["mfu_today"] = today  # the training section's, at its 65,536 tokens a step
    last = 0.0
    for key, variant in ORDER:
        entry = result["configs"][key]
        left = ctx.seconds_left()
        if left is not None and left < 1.2 * last + 2:
            entry[variant] = {"skipped": f"{left:.0f} s left of the limit, the last variant took {last:.0f} s"}
            continue
        extra = [f"train.batch_tokens={PAPER_TOKENS[ctx.mode]}", *VARIANTS[variant]]

        def cfg_for(more, key=key, extra=extra):
            return paper_config(key, ctx.mode, data_dir(ctx), [*extra, *more])

        t0 = time.perf_counter()
        entry[variant] = with_eager_fallback(ctx, cfg_for, lambda more, suffix, key=key, variant=variant: measure(
            ctx, key, variant, cfg_for(more), fresh_dir(ctx, f"profile_{key}_{variant}{suffix}"), device, peak),
            device)
        last = entry[variant]["seconds"] = time.perf_counter() - t0
        ctx.partial(result)
    print("profile: " + summary_line(result), flush=True)
    return result


def _f(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


def summary_line(r: dict) -> str:
    """Per config and variant: step s, MFU at the paper's tokens per step (and today's), optimizer s, the largest
    region."""
    parts = []
    for key, entry in (r.get("configs") or {}).items():
        for variant in VARIANTS:
            v = entry.get(variant) or {}
            if "step_s" not in v:
                continue
            regions = v.get("regions") or {}
            top = max(regions.items(), key=lambda kv: kv[1]["s"])[0] if regions else None
            parts.append(f"{key}/{variant} step {_f(v['step_s'], '.4g')} s, MFU {_f(v.get('mfu_vs_datasheet'))} "
                         f"(today {_f(entry.get('mfu_today'))}), optimizer {_f(v.get('optimizer_s'), '.3g')} s, "
                         f"largest {top}")
    return "; ".join(parts) or "no variant measured"
