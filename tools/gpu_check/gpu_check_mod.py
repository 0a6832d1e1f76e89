"""The mod_speed section of tools/gpu_check/gpu_check.sh (issues 59 and 69): MoD against NAG in step time, in one
process, through the real `Trainer` at the training sections' size (gpu_check_configs.overrides), on the compile
caches the training sections left.

Issue 52's GPU run found NAG+MoD-20% 33x slower than NAG (gather MoD: new shapes every step, a host read per
sublayer). `model.mod.impl=static` (the CUDA default) has fixed shapes and no host read, but computes every row's
attention and router: it skips only the MoE's expert GEMMs (nagmoe/config/flops.py). The section:
  1. NAG (configs/paper/nag-r40.yaml): WARMUP steps, then TIMED steps;
  2. NAG+MoD-20% (nag-mod20-r40.yaml): WARMUP steps (the score histograms; skipping starts), then for each rate of
     RATES the compute dial (`model.set_mod_skip_rate`) settled on the current scores (`settle`: SETTLE untimed
     steps), its thresholds then pinned (`PinnedThresholds`: the calibrator's update after each step would move
     them and the realised skip would drift), TIMED steps;
     every timed phase records step time (CUDA events; perf_counter on the CPU) and forward+backward per micro-step,
     the realised skip (work-weighted over the eligible sublayers; the MoE sublayers' own token skip, which is what
     the expert GEMMs skip), graphs compiled and graph breaks during its steps (dynamo's counters: a recompile is a
     new graph), peak memory (GPU); then one step under SyncCounter (host reads per step, their sites) and, on CUDA,
     one under sync debug mode "error";
  3. per rate, one step under torch.profiler (tools/bench/step_profile.py): the kernel table in
     $RESULTS/mod_speed_profile_<rate>.txt and time by region; rate 0's gives two shares of the step, `share_eligible`
     (the MoD-eligible sublayers, forward and backward) and `share_experts` (the MoE's grouped GEMMs alone). A profile
     that would not fit what is left of the limit is skipped and said so (--cpu profiles rate 0 only).
`answer`: per rate the MoD / NAG step time and saved = 1 - step(rate) / step(MoD at 0) against skip x share for both
shares; issue 59's bar at 0.2 is held against what static can save, the expert GEMMs: saved >= 0.9 x the MoE skip x
share_experts (`meets_0_9`). Results so far are in bench.json after every phase; a failed compile is recorded and
the section runs again eager (gpu_check_train.with_eager_fallback). --cpu: the same at tiny width with
model.mod.impl=static (the GPU's implementation; auto is gather on a CPU).
"""
from __future__ import annotations

import bisect
import os
import statistics
import time

from gpu_check_common import SectionFailed
from gpu_check_configs import PAPER, WARMUP_STEPS, overrides, paper_config
from gpu_check_train import (ahead_estimate, data_dir, device_info, dynamo_counts, fresh_dir, free_memory,
                             memory_estimate, one_step, sync, with_eager_fallback)

KEY, BASE = "nag_mod20", "nag"  # the MoD config and the NAG it is timed against (PAPER's keys)
RATES = (0.0, 0.2, 0.5)
# at least 2 steps: the histograms the dial reads, and skipping started (NAG's injection warm-up, WARMUP_STEPS)
WARMUP = {mode: max(2, n) for mode, n in WARMUP_STEPS.items()}
TIMED = {"gpu": 8, "cpu": 8}  # timed steps per phase (issue 69: >= 8; ~0.4 s each on the H200, ~0.35 s on the CPU)
SETTLE = {"gpu": 4, "cpu": 2}  # untimed steps per rate that bring the realised skip to the rate (`settle`)
MOD_IMPL = {"gpu": [], "cpu": ["model.mod.impl=static"]}  # the GPU's auto is static; the CPU rehearses it
TARGET_RATE, TARGET_SHARE = 0.2, 0.9  # issue 59: skipping 20% saves at least 0.9 of its share of the step
REGION = "gpu_check.sublayer."  # SublayerRegions' default region names
BACKWARD = "autograd::engine::evaluate_function: "
ELIGIBLE_REGIONS = ("attention", "moe_gemm", "moe_glue", "ffn")  # step_profile's regions of the sublayers


def rate_key(rate: float) -> str:
    return f"{rate:g}"  # "0", "0.2", "0.5": the JSON keys and the profile files' names


# ----------------------------------------------------------------------------------------------------------
# Timing inside the trainer's own step
# ----------------------------------------------------------------------------------------------------------
class MicroSteps:
    """Forward + backward of each micro-step inside `Trainer.train_step`, without touching the trainer: the model's
    forward pre-hook marks the start; a hook on the loss (it fires as the backward begins) queues an autograd
    callback, which runs once the whole backward has been issued, and marks the end. CUDA events on a GPU (no
    host wait inside the step), perf_counter on the CPU."""

    def __init__(self, model, device):
        import torch

        self.torch, self.cuda, self.marks = torch, device.type == "cuda", []
        self.handles = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._forward)]

    def _mark(self):
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, module, args):
        if self.torch.is_grad_enabled():
            self.marks.append([self._mark(), None])

    def _forward(self, module, args, out):
        loss = getattr(out, "loss", None)
        if not self.marks or loss is None or not loss.requires_grad:
            return
        pair, engine = self.marks[-1], self.torch.autograd.Variable._execution_engine

        def begun(grad):
            engine.queue_callback(lambda: pair.__setitem__(1, self._mark()))

        loss.register_hook(begun)

    def take(self) -> list[float]:
        """The seconds of each finished micro-step since the last call (after the device caught up)."""
        if self.cuda:
            self.torch.cuda.synchronize()
        done = [p for p in self.marks if p[1] is not None]
        self.marks = []
        return [a.elapsed_time(b) / 1e3 if self.cuda else b - a for a, b in done]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------------------------------------
# Profiler regions around sublayers (tools/bench/step_profile.py's regions)
# ----------------------------------------------------------------------------------------------------------
class SublayerRegions:
    """A torch.profiler.record_function region around each call of a MoD-eligible sublayer (forward hooks of this
    tool: nothing in the model changes), named by the sublayer's class; tools/bench/step_profile.py's region_table links
    their backward.
    `eligible` (one flag per sublayer, default all) picks the sublayers, `name_of(sublayer)` names their regions
    (tools/bench/step_profile.py names them by role)."""

    def __init__(self, model, eligible=None, name_of=None):
        from torch.profiler import record_function

        self.handles, self.open = [], {}
        subs = list(model.sublayers())
        for sub, ok in zip(subs, eligible if eligible is not None else [True] * len(subs)):
            if not ok:
                continue
            name = name_of(sub) if name_of is not None else REGION + type(sub).__name__

            def enter(module, args, name=name):
                region = record_function(name)
                region.__enter__()
                self.open.setdefault(id(module), []).append(region)

            def leave(module, args, out):
                self.open[id(module)].pop().__exit__(None, None, None)

            self.handles += [sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave)]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _spans(host, prefix: str) -> dict:
    """{thread: sorted [(start, end, name after the prefix)]} of the host events whose names start with `prefix`."""
    spans = {}
    for e in host:
        if e.name.startswith(prefix):
            spans.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end, e.name[len(prefix):]))
    return {t: sorted(v) for t, v in spans.items()}


def _inside(spans: dict, e):
    """The name of the span of `spans` (same thread) that holds event `e`, or None."""
    found = spans.get(e.thread)
    if not found:
        return None
    i = bisect.bisect_right(found, (e.time_range.start, float("inf"), "")) - 1
    return found[i][2] if i >= 0 and e.time_range.end <= found[i][1] else None


# ----------------------------------------------------------------------------------------------------------
# Host reads
# ----------------------------------------------------------------------------------------------------------
def counted_step(trainer) -> dict:
    """One step under SyncCounter, every compiled region eager (the same ops, counted; the step's time is not used):
    dynamo skips frames under its dispatch mode, and a fullgraph=True unit (static MoD's, nagmoe/train/speed.py)
    then raises "found no compiled frames" instead (seen on the CPU with train.compile=true, torch 2.13)."""
    import torch

    from nagmoe.train.sync_count import SyncCounter

    with torch.compiler.set_stance("force_eager"), SyncCounter() as counter:
        one_step(trainer)
    top = sorted(counter.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    return {"syncs_per_step": counter.total, "sync_sites": dict(top)}


def sync_error_step(trainer) -> dict:
    """CUDA: one step under set_sync_debug_mode("error"). A raise leaves the step half done: its gradients and
    (MoD) the pending counts are dropped so the next step starts clean."""
    import traceback

    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        one_step(trainer)
        return {"raised": False, "message": None, "site": None}
    except RuntimeError as e:
        frames = traceback.extract_tb(e.__traceback__)
        ours = [f for f in frames if f"{os.sep}nagmoe{os.sep}" in f.filename] or frames
        site = f"{os.path.relpath(ours[-1].filename, os.getcwd())}:{ours[-1].lineno}" if ours else None
        return {"raised": True, "message": str(e)[:300], "site": site}
    finally:
        torch.cuda.set_sync_debug_mode("default")
        trainer.optim.zero_grad(set_to_none=True)
        cal = trainer.model.mod_calibrator()
        for name in ("pending_hist", "pending_executed", "pending_tokens", "pending_padded") if cal else ():
            getattr(cal, name).zero_()


# ----------------------------------------------------------------------------------------------------------
# Timed phases
# ----------------------------------------------------------------------------------------------------------
class PinnedThresholds:
    """The dial's thresholds and skip flags kept through training steps: the calibrator's `update` (after every
    optimizer step) still folds in the counts, then this puts the pinned values back in place (device copies into
    the same buffers: no host read, nothing for a compiled unit to notice)."""

    def __init__(self, cal):
        self.cal, self.threshold, self.skipping = cal, cal.threshold.clone(), cal.skipping.clone()
        self.update = cal.update
        cal.update = self._update  # an instance attribute over the method, removed by close()

    def _update(self, *args, **kwargs):
        out = self.update(*args, **kwargs)
        self.cal.threshold.copy_(self.threshold)
        self.cal.skipping.copy_(self.skipping)
        return out

    def close(self) -> None:
        del self.cal.update


def skips(cal, fractions: list, moe: bool) -> dict:
    """What the timed steps skipped: the token-weighted executed fraction over the eligible sublayers, the
    work-weighted skip (what model.mod.skip_rate targets), and the token skip of the MoE sublayers (odd indices) and
    of the attention sublayers (even) on their own; the mean over the steps, per sublayer."""
    mean = [statistics.mean(f) for f in zip(*fractions)]
    ok = cal.eligible_list

    def token_skip(parity):
        own = [f for i, (f, e) in enumerate(zip(mean, ok)) if e and i % 2 == parity]
        return 1.0 - statistics.mean(own) if own else None

    return {"executed_fraction": 1.0 - cal.token_skip_rate(mean), "skip_rate_work": cal.skip_rate_of(mean),
            "moe_skip": token_skip(1) if moe else None, "attention_skip": token_skip(0),
            "executed_fractions": mean,
            "skip_rate_work_all": [cal.skip_rate_of(f) for f in fractions]}  # pinned: any drift is the scores'


def timed_steps(trainer, device, n: int) -> dict:
    """`n` training steps timed one by one, each micro-step's forward+backward, dynamo's new graphs and graph
    breaks during them, peak memory (CUDA); with MoD each step's executed fractions."""
    import torch

    cuda, cal = device.type == "cuda", trainer.model.mod_calibrator()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    micro, dynamo0 = MicroSteps(trainer.model, device), dynamo_counts()
    steps, micro_s, losses, fractions = [], [], [], []
    try:
        for _ in range(n):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            rec = one_step(trainer)  # its metrics read waits for the device: the step's end on the host
            if cuda:
                end.record()
                end.synchronize()
            steps.append(start.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - t0)
            micro_s += micro.take()
            losses.append(float(rec["loss"]))
            if cal is not None:
                fractions.append(list(cal.last_step["executed"]))
    finally:
        micro.close()
    out = {"step_s": statistics.median(steps), "step_s_all": steps, "micro_step_s": statistics.median(micro_s),
           "micro_step_s_all": micro_s, "micro_steps_per_step": trainer.accum, "losses": losses,
           "dynamo": {k: v - dynamo0[k] for k, v in dynamo_counts().items()},
           "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    if cal is not None:
        out.update(skips(cal, fractions, trainer.cfg.model.ffn == "moe"))
    return out


def reads(trainer, device) -> dict:
    """Host reads of one step (counted eagerly) and, on CUDA, the step under sync debug mode "error"; after the
    timed steps, whose peak memory they would change."""
    out = counted_step(trainer)
    out["sync_error"] = sync_error_step(trainer) if device.type == "cuda" else None
    return out


def build(ctx, key: str, cfg, device, suffix: str):
    """A Trainer for configs/paper/<PAPER[key]>.yaml; on CUDA with the committed memory estimate (as the training
    sections: estimating at paper width costs a minute of host CPU)."""
    from nagmoe.train.trainer import Trainer

    ahead = ahead_estimate(memory_estimate(key, cfg, device), cfg, device) if device.type == "cuda" else None
    free_memory()
    return Trainer(cfg, fresh_dir(ctx, f"mod_speed_{key}{suffix}"), eager_memory_estimate=ahead)


def warm_up(trainer, device, n: int) -> list:
    seconds = []
    for _ in range(n):
        t0 = time.perf_counter()
        one_step(trainer)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    return seconds


def nag_phase(ctx, cfg, device, suffix: str) -> dict:
    """NAG's timed steps and host reads; its trainer is gone (memory freed) before MoD's is built."""
    trainer = build(ctx, BASE, cfg, device, suffix)
    try:
        warm = warm_up(trainer, device, WARMUP_STEPS[ctx.mode])
        out = {"config": f"configs/paper/{PAPER[BASE]}.yaml", "warmup_s": warm, "backends": trainer.backends,
               **timed_steps(trainer, device, TIMED[ctx.mode]), **reads(trainer, device)}
    finally:
        trainer.release_lease()
    del trainer
    free_memory()
    return out


def pinned_step(trainer):
    pinned = PinnedThresholds(trainer.model.mod_calibrator())
    try:
        return one_step(trainer)
    finally:
        pinned.close()


def settle(trainer, rate: float, n: int) -> dict:
    """Thresholds that realise `rate` on the scores of now: the histograms hold the warm-up's scores, which the
    early steps move (the dial at level `rate` realised 0.04 for 0.2 on the CPU). The dial at level l, one training
    step at those thresholds, then the next level by the secant through the last two (level, realised) pairs (the
    first correction l + rate - realised, calibrate_skip_rate's), `n` times; then the dial at the last level. Global
    and fixed modes: one level for every sublayer."""
    cal, tried = trainer.model.mod_calibrator(), []
    level = rate
    for _ in range(n if rate > 0 and cal.mode != "per_sublayer" else 0):
        trainer.model.set_mod_skip_rate(rate, level)
        pinned_step(trainer)
        tried.append((level, cal.skip_rate_of(cal.last_step["executed"])))
        (l1, s1), (l0, s0) = tried[-1], tried[-2] if len(tried) > 1 else (None, None)
        slope = (s1 - s0) / (l1 - l0) if l0 is not None and l1 != l0 and s1 != s0 else 1.0
        level = min(0.99, max(0.0, l1 + (rate - s1) / max(slope, 0.1)))  # a flat or falling slope: steps of 1
    trainer.model.set_mod_skip_rate(rate, level)
    return {"level": level, "settle_skips": [s for _, s in tried]}


def rate_phase(trainer, rate: float, device, n: int, settle_steps: int) -> dict:
    """The dial at `rate` (settled), then pinned: the timed steps and the host reads at fixed thresholds."""
    found = settle(trainer, rate, settle_steps)
    pinned = PinnedThresholds(trainer.model.mod_calibrator())
    try:
        return {**found, **timed_steps(trainer, device, n), **reads(trainer, device)}
    finally:
        pinned.close()


def profiles(ctx, trainer, out: dict, device) -> None:
    """One profiled step per rate (rate 0 first: the shares), each skipped when it would not fit what is left of
    the limit (room for one more like the last, and the exit)."""
    from step_profile import profile_step

    all_eligible = all(trainer.model.mod_calibrator().eligible_list)
    last = 0.0
    for rate in RATES:
        r, left = out["rates"][rate_key(rate)], ctx.seconds_left()
        if ctx.mode == "cpu" and rate != 0:  # the rehearsal: rate 0's profile (the shares) proves the path; two more
            r["profile"] = None  # would not fit a 2-core CI machine's budget (seconds of parsing each)
            r["profile_skipped"] = "cpu mode: only rate 0 is profiled (the GPU profiles every rate)"
            continue
        if left is not None and left < 1.2 * last + 2:
            r["profile"], r["profile_skipped"] = None, f"{left:.0f} s left of the limit, the last took {last:.0f} s"
            continue
        t0 = time.perf_counter()
        trainer.model.set_mod_skip_rate(rate, r.get("level"))  # the settled thresholds of the timed steps
        pinned = PinnedThresholds(trainer.model.mod_calibrator())
        path = os.path.join(ctx.out, f"mod_speed_profile_{rate_key(rate)}.txt")
        try:
            found = profile_step(trainer, path)
        finally:
            pinned.close()
        last = time.perf_counter() - t0
        total = found["total_s"] or float("nan")
        r.update(profile=os.path.basename(path), profile_s=last, launches=found["launches"],
                 regions={k: v["s"] / total for k, v in found["regions"].items()})
        if rate == 0:  # the full-depth step's shares (the eligible one needs every sublayer eligible)
            out["share_eligible"] = (sum(r["regions"][k] for k in ELIGIBLE_REGIONS) if all_eligible else None)
            out["share_experts"] = r["regions"]["moe_gemm"]
        out.update(answer(out))
        ctx.partial(out)


def measure(ctx, cfg_for, device, extra: list, suffix: str) -> dict:
    """NAG, then MoD at every rate, then the profiles; bench.json gets the results after each phase."""
    out = {"config": f"configs/paper/{PAPER[KEY]}.yaml", "overrides": overrides(ctx.mode, data_dir(ctx)),
           "timed_steps": TIMED[ctx.mode], "rates": {}}
    dynamo0 = dynamo_counts()
    out["nag"] = nag_phase(ctx, cfg_for(BASE, extra), device, suffix)
    ctx.partial(out)
    trainer = build(ctx, KEY, cfg_for(KEY, [*MOD_IMPL[ctx.mode], *extra]), device, suffix)
    try:
        cal = trainer.model.mod_calibrator()
        if cal is None:
            raise SectionFailed(f"configs/paper/{PAPER[KEY]}.yaml built no MoD calibrator", out)
        out["warmup_s"] = warm_up(trainer, device, WARMUP[ctx.mode])
        out.update(mod_impl=trainer.backends.get("MoD.impl"), backends=trainer.backends,
                   batch_tokens=trainer.cfg.train.batch_tokens, grad_accum=trainer.accum,
                   skipping_after_warmup=bool(cal.skipping.any()))
        for rate in RATES:
            out["rates"][rate_key(rate)] = rate_phase(trainer, rate, device, TIMED[ctx.mode], SETTLE[ctx.mode])
            out.update(answer(out))
            ctx.partial(out)
        out["dynamo_section"] = {k: v - dynamo0[k] for k, v in dynamo_counts().items()}  # compiles included
        profiles(ctx, trainer, out, device)
        out["backends_ran"] = trainer.backends_ran
    finally:
        trainer.release_lease()
    return {**out, **answer(out)}


# ----------------------------------------------------------------------------------------------------------
# The answer
# ----------------------------------------------------------------------------------------------------------
def _ratio(a, b):
    return a / b if a is not None and b else None


def answer(out: dict) -> dict:
    """Per rate: MoD / NAG step time; saved = 1 - step(rate) / step(MoD at 0) against skip x share for both
    shares (`realised_vs_*`: the saving as a share of that target). At TARGET_RATE issue 59's bar, held against
    the expert GEMMs (what static skips): saved >= 0.9 x the MoE sublayers' skip x share_experts."""
    rates, nag = out.get("rates") or {}, (out.get("nag") or {}).get("step_s")
    base = (rates.get(rate_key(0)) or {}).get("step_s")
    per = {}
    for key, r in rates.items():
        a = {"mod_over_nag": _ratio(r["step_s"], nag)}
        if base and key != rate_key(0):
            saved = 1.0 - r["step_s"] / base
            eligible = (None if out.get("share_eligible") is None else r["skip_rate_work"] * out["share_eligible"])
            experts = (None if out.get("share_experts") is None or r.get("moe_skip") is None
                       else r["moe_skip"] * out["share_experts"])
            a.update(saved=saved, target_eligible=eligible, realised_vs_eligible=_ratio(saved, eligible),
                     target_experts=experts, realised_vs_experts=_ratio(saved, experts))
        per[key] = a
    at = per.get(rate_key(TARGET_RATE)) or {}
    meets = (None if at.get("target_experts") is None else at["saved"] >= TARGET_SHARE * at["target_experts"])
    return {"answer": per, "mod20_over_nag": at.get("mod_over_nag"), "saved_0_2": at.get("saved"),
            "meets_0_9": meets}


def section_mod_speed(ctx) -> dict:
    import torch

    device, name, _, warnings = device_info()
    ctx.note_machine(torch=torch.__version__, device=name, **({"warnings": warnings} if warnings else {}))

    def cfg_for(key, extra):
        return paper_config(key, ctx.mode, data_dir(ctx), extra)

    res = with_eager_fallback(ctx, lambda extra: cfg_for(KEY, extra),
                              lambda extra, suffix: measure(ctx, cfg_for, device, extra, suffix), device)
    result = {"device": name, "torch": torch.__version__, **res}
    print(f"mod_speed: {summary_line(result)}", flush=True)
    return result


def _f(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


def summary_line(r: dict) -> str:
    """One line for the summary: MoD / NAG step time per rate, the MoE skip, the saving at 0.2 against both
    targets, new graphs and breaks in the timed steps, host reads per step (NAG, then each rate)."""
    rates, per = r.get("rates") or {}, r.get("answer") or {}
    keys = [rate_key(x) for x in RATES]

    def each(get, spec):
        return "/".join(_f(get(k), spec) for k in keys)

    at = per.get(rate_key(TARGET_RATE)) or {}
    phases = [r.get("nag") or {}, *(rates.get(k) or {} for k in keys)]
    graphs = sum((p.get("dynamo") or {}).get("unique_graphs", 0) for p in phases)
    breaks = sum((p.get("dynamo") or {}).get("graph_breaks", 0) for p in phases)
    syncs = "/".join(_f(p.get("syncs_per_step"), "d") for p in phases)
    return (f"MoD speed ({r.get('mod_impl')}, {r.get('compile')}): MoD/NAG step at {'/'.join(keys)}: "
            f"{each(lambda k: (per.get(k) or {}).get('mod_over_nag'), '.3f')} (NAG "
            f"{_f((r.get('nag') or {}).get('step_s'), '.4g')} s); MoE skip "
            f"{each(lambda k: (rates.get(k) or {}).get('moe_skip'), '.2f')}; saved at 0.2 {_f(at.get('saved'))} vs "
            f"experts' target {_f(at.get('target_experts'))} (share {_f(r.get('share_experts'))}), eligible target "
            f"{_f(at.get('target_eligible'))} (share {_f(r.get('share_eligible'))}): meets 0.9 {r.get('meets_0_9')}; "
            f"timed steps: {graphs} new graphs, {breaks} breaks; syncs/step NAG/{'/'.join(keys)} {syncs}")
