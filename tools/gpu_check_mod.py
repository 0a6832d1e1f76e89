"""The mod_speed section of tools/gpu_check.sh (issue 59): what MoD's skipping buys in step time, through the real
`Trainer` on configs/paper/nag-mod20-r40.yaml at the training sections' size (gpu_check_configs.overrides).

The first GPU run found NAG+MoD-20% 33x slower than NAG (gather MoD: new shapes every step, a host read per
sublayer). `model.mod.impl=static` (the CUDA default) has fixed shapes and no host read; this section says whether
it realises the saving issue 59 asks for. After WARMUP training steps (MoD's score histograms), the compute dial
(`model.set_mod_skip_rate`) pins each rate of RATES (0 = NAG's compute) and, per rate:
  * TIMED steps: step time and forward+backward time per micro-step (CUDA events on a GPU, perf_counter on the
    CPU), the realised executed fraction (the calibrator's `last_step`), peak memory (GPU);
  * one step under `nagmoe.train.sync_count.SyncCounter` (compiled regions eager): host reads per step, their sites;
  * on CUDA one step under `torch.cuda.set_sync_debug_mode("error")`: whether it raised, where, and the message
    (the trainer's own metrics read syncs by design: the site says whose sync came first);
then, every rate's numbers kept, one step per rate under torch.profiler: the kernel table in
$RESULTS/mod_speed_profile_<rate>.txt (one that would not fit the section's limit is skipped and said so).
From rate 0's profile, the skippable share: the share of the step's self time spent in the MoD-eligible sublayers
(`skippable_shares`). Issue 59's check: saved = 1 - step_s(0.2) / step_s(0) against 0.9 * 0.2 * skippable share
(`meets_0_9`; `target_0_2_realised` puts the skip the dial realised in place of 0.2). A failed compile is recorded
and the section runs again eager (gpu_check_train.with_eager_fallback).
"""
from __future__ import annotations

import bisect
import os
import re
import statistics
import time

from gpu_check_common import SectionFailed
from gpu_check_configs import PAPER, WARMUP_STEPS, overrides, paper_config
from gpu_check_train import (ahead_estimate, data_dir, device_info, fresh_dir, free_memory, memory_estimate,
                             one_step, sync, with_eager_fallback)

KEY = "nag_mod20"
RATES = (0.0, 0.2, 0.5)
# at least 2 steps: the histograms the dial reads, and skipping started (NAG's injection warm-up, WARMUP_STEPS)
WARMUP = {mode: max(2, n) for mode, n in WARMUP_STEPS.items()}
TIMED = {"gpu": 2, "cpu": 2}  # steps timed per rate: 5 steps per rate on the GPU must fit the section's 80 s
TARGET_RATE, TARGET_SHARE = 0.2, 0.9  # issue 59: skipping 20% saves at least 0.9 of its share of the step
REGION = "gpu_check.sublayer."  # the profiler regions this tool opens around each MoD-eligible sublayer call
BACKWARD = "autograd::engine::evaluate_function: "


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
# The profile: the kernel table and the skippable share
# ----------------------------------------------------------------------------------------------------------
class SublayerRegions:
    """A torch.profiler.record_function region around each call of a MoD-eligible sublayer (forward hooks of this
    tool: nothing in the model changes), named by the sublayer's class; `skippable_shares` links their backward.
    `eligible` (one flag per sublayer, default all) picks the sublayers, `name_of(sublayer)` names their regions
    (tools/step_profile.py names them by role)."""

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


def _op_time(event, cuda: bool, self_only: bool) -> float:
    if cuda:
        return event.self_device_time_total if self_only else event.device_time_total
    return event.self_cpu_time_total if self_only else event.cpu_time_total


# The cross-check by op names (skippable_share_ops): attention kernels, CCA's convolutions, the MoE's grouped GEMMs
# and every matmul but the LM head's (the vocabulary in its weight operand). Under torch.compile the Triton kernels
# of the compiled sublayers count as not skippable: a lower bound there.
SKIPPABLE_OPS = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|_grouped_mm|"
                           r"conv(olution|\d|_depthwise)|"
                           r"^aten::(mm|addmm|bmm|baddbmm|_softmax|_softmax_backward_data)$")


def _lm_head_matmul(shapes, d: int, v: int) -> bool:
    """A matmul of the LM head: its weight [V, D] (or its transpose) an operand, or its weight gradient's
    operands ([V, n] @ [n, D], [D, n] @ [n, V])."""
    mats = [s for s in shapes or () if len(s) == 2][-2:]
    if len(mats) < 2:
        return False
    a, b = mats
    return sorted(b) == sorted((d, v)) or (a[0] == v and b[1] == d) or (a[0] == d and b[1] == v)


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


def skippable_shares(events, cuda: bool, d_model: int, vocab: int) -> dict:
    """Shares of the profiled step's self time (device time on CUDA, CPU time on the CPU; the denominator: every
    host event's self time, each kernel counted once under the op that launched it) spent in MoD-eligible
    sublayers. The rule (`skippable_share`): their forward is each SublayerRegions region's whole time; their
    backward is each autograd node the ops inside a region created, found by its sequence number (what the
    profiler's own forward/backward links use), its whole evaluate_function time. An op creating no node carries
    the next node's number: at a region's end, one node of what follows may count with it (small).
    `skippable_share_ops` is the cross-check by op names (SKIPPABLE_OPS), the optimizer's matmuls left out."""
    from torch.autograd import DeviceType

    host = [e for e in events if e.device_type == DeviceType.CPU]
    total = sum(_op_time(e, cuda, True) for e in host)
    regions, optimizer = _spans(host, REGION), _spans(host, "Optimizer.")
    by_kind, seq_kind = {}, {}
    for e in host:
        if e.name.startswith(REGION):
            kind = e.name[len(REGION):]
            by_kind[kind] = by_kind.get(kind, 0.0) + _op_time(e, cuda, False)
        elif e.sequence_nr >= 0 and not e.name.startswith(BACKWARD):
            kind = _inside(regions, e)
            if kind is not None:
                seq_kind[(e.thread, e.sequence_nr)] = kind
    backward = ops = 0.0
    for e in host:
        if e.name.startswith(BACKWARD) and e.sequence_nr >= 0:
            kind = seq_kind.get((getattr(e, "fwd_thread", e.thread), e.sequence_nr))
            if kind is not None:
                by_kind[kind] += _op_time(e, cuda, False)
                backward += _op_time(e, cuda, False)
        elif (SKIPPABLE_OPS.search(e.name) and _inside(optimizer, e) is None
              and not (e.name.endswith("mm") and _lm_head_matmul(e.input_shapes, d_model, vocab))):
            ops += _op_time(e, cuda, True)

    def share(x):
        return x / total if total > 0 else None

    return {"skippable_share": share(sum(by_kind.values())) if by_kind else None,
            "skippable_share_by_sublayer": {k: share(v) for k, v in sorted(by_kind.items())},
            "skippable_backward_share": share(backward), "skippable_share_ops": share(ops),
            "profiled_self_s": total / 1e6}


def profiled_step(trainer, device, path: str, eligible, shares: bool) -> dict:
    """One training step under torch.profiler (the CUDA activity on a GPU), its kernel table written to `path`;
    with `shares` the skippable shares of that step (skippable_shares)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    regions = SublayerRegions(trainer.model, eligible) if shares else None
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, record_shapes=shares) as prof:
            one_step(trainer)
            sync(device)
    finally:
        if regions is not None:
            regions.close()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=sort, row_limit=40) + "\n")
    out = {"profile": os.path.basename(path)}
    if shares:
        m = trainer.cfg.model
        out.update(skippable_shares(prof.events(), cuda, m.d_model, m.vocab_size))
    return out


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
    MoD's pending counts are dropped so the next step starts clean."""
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
        for name in ("pending_hist", "pending_executed", "pending_tokens", "pending_padded"):
            getattr(cal, name).zero_()


# ----------------------------------------------------------------------------------------------------------
# The section
# ----------------------------------------------------------------------------------------------------------
def executed_fraction(cal) -> tuple[float, float]:
    """(token-weighted executed fraction over the eligible sublayers, the work-weighted skip) of the last step."""
    fractions = cal.last_step["executed"]
    return 1.0 - cal.token_skip_rate(fractions), cal.skip_rate_of(fractions)


def timed_rate(trainer, cal, rate: float, device, timed: int) -> dict:
    """The dial at `rate`, then its timed steps, the counted step and (CUDA) the sync-error step."""
    import torch

    cuda = device.type == "cuda"
    trainer.model.set_mod_skip_rate(rate)  # the dial: thresholds from the histograms, skipping at once
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    micro = MicroSteps(trainer.model, device)
    steps, micro_s, executed, skip, losses = [], [], [], [], []
    try:
        for _ in range(timed):
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
            e, s = executed_fraction(cal)
            executed.append(e)
            skip.append(s)
            losses.append(float(rec["loss"]))
    finally:
        micro.close()
    # the peak of the timed steps only: the counted step runs the compiled regions eagerly
    out = {"step_s": statistics.median(steps), "step_s_all": steps, "micro_step_s": statistics.median(micro_s),
           "micro_step_s_all": micro_s, "micro_steps_per_step": trainer.accum,
           "executed_fraction": statistics.mean(executed), "skip_rate_work": statistics.mean(skip),
           "losses": losses, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    out.update(counted_step(trainer))
    out["sync_error"] = sync_error_step(trainer) if cuda else None
    return out


def measure(ctx, cfg, run_dir: str, device) -> dict:
    """Every rate's timings and host reads first, then the profiles (rate 0's first: the skippable share). Parsing
    a profile is host work that grows with the events (seconds at paper size): a profile that would not fit what
    is left of the section's limit is skipped and said so, and a section killed at its limit keeps the rest."""
    from nagmoe.train.trainer import Trainer

    # CUDA: the committed estimate for the trainer's memory refusal or the loss's plan (as the training sections)
    ahead = ahead_estimate(memory_estimate(KEY, cfg, device), cfg, device) if device.type == "cuda" else None
    free_memory()
    trainer = Trainer(cfg, run_dir, eager_memory_estimate=ahead)
    try:
        cal = trainer.model.mod_calibrator()
        if cal is None:
            raise SectionFailed(f"configs/paper/{PAPER[KEY]}.yaml built no MoD calibrator", {})
        warm_s = []
        for _ in range(WARMUP[ctx.mode]):
            t0 = time.perf_counter()
            one_step(trainer)
            sync(device)
            warm_s.append(time.perf_counter() - t0)
        out = {"config": f"configs/paper/{PAPER[KEY]}.yaml", "overrides": overrides(ctx.mode, data_dir(ctx)),
               "mod_impl": trainer.backends.get("MoD.impl"), "backends": trainer.backends,
               "batch_tokens": cfg.train.batch_tokens, "grad_accum": trainer.accum, "warmup_steps": len(warm_s),
               "warmup_s": warm_s, "timed_steps_per_rate": TIMED[ctx.mode], "skipping_after_warmup":
               bool(cal.skipping.any()), "rates": {}}
        for rate in RATES:
            out["rates"][rate_key(rate)] = timed_rate(trainer, cal, rate, device, TIMED[ctx.mode])
            ctx.partial(out)
        last = 0.0  # the wall seconds of the last profile (step and parse)
        for rate in RATES:
            r = out["rates"][rate_key(rate)]
            left = ctx.seconds_left()
            if ctx.mode == "cpu" and rate != 0:  # the rehearsal: rate 0's profile (the share) proves the path; on a
                r["profile"] = None  # 2-core CI machine under load two more would not fit the section's limit
                r["profile_skipped"] = "cpu mode: only rate 0 is profiled (the GPU profiles every rate)"
                continue
            if left is not None and left < 1.2 * last + 2:  # room for one more like the last, and the exit
                r["profile"] = None
                r["profile_skipped"] = f"{left:.0f} s left of the limit, the last profile took {last:.0f} s"
                continue
            t0 = time.perf_counter()
            trainer.model.set_mod_skip_rate(rate)
            path = os.path.join(ctx.out, f"mod_speed_profile_{rate_key(rate)}.txt")
            found = profiled_step(trainer, device, path, cal.eligible_list, shares=rate == 0)
            last = time.perf_counter() - t0
            for k in [k for k in found if k.startswith("skippable_") or k == "profiled_self_s"]:
                out[k] = found.pop(k)  # rate 0's: the full-depth step's shares
            r.update(found, profile_s=last)
            out.update(issue59(out))
            ctx.partial(out)
        out["backends_ran"] = trainer.backends_ran
    finally:
        trainer.release_lease()
    return {**out, **issue59(out)}


def issue59(out: dict) -> dict:
    """saved = 1 - step_s(0.2) / step_s(0) against 0.9 * 0.2 * the skippable share (the FLOP-free reading of
    issue 59: skipping 20% of the skippable work saves at least 90% of that work's share of the step)."""
    rates, share = out["rates"], out.get("skippable_share")
    if share is None:
        share = out.get("skippable_share_ops")
    base, at = rates.get(rate_key(0)), rates.get(rate_key(TARGET_RATE))
    if not base or not at or share is None:
        return {"saved_0_2": None, "target_0_2": None, "meets_0_9": None, "target_0_2_realised": None}
    saved = 1.0 - at["step_s"] / base["step_s"]
    target = TARGET_SHARE * TARGET_RATE * share
    # beside it, the target at the skip the dial realised (the work-weighted skip of the timed steps)
    return {"saved_0_2": saved, "target_0_2": target, "meets_0_9": saved >= target,
            "target_0_2_realised": TARGET_SHARE * at["skip_rate_work"] * share}


def section_mod_speed(ctx) -> dict:
    import torch

    device, name, _, warnings = device_info()
    ctx.note_machine(torch=torch.__version__, device=name, **({"warnings": warnings} if warnings else {}))

    def cfg_for(extra):
        return paper_config(KEY, ctx.mode, data_dir(ctx), extra)

    res = with_eager_fallback(ctx, cfg_for, lambda extra, suffix: measure(
        ctx, cfg_for(extra), fresh_dir(ctx, "mod_speed" + suffix), device), device)
    result = {"device": name, "torch": torch.__version__, **res}
    print(f"mod_speed: {summary_line(result)}", flush=True)
    return result


def _f(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


def summary_line(r: dict) -> str:
    """One line for the summary: step time per rate, issue 59's check, host reads per step."""
    rates = r.get("rates") or {}
    steps = "/".join(_f((rates.get(rate_key(x)) or {}).get("step_s"), ".4g") for x in RATES)
    syncs = "/".join(_f((rates.get(rate_key(x)) or {}).get("syncs_per_step"), "d") for x in RATES)
    executed = "/".join(_f((rates.get(rate_key(x)) or {}).get("executed_fraction"), ".2f") for x in RATES)
    return (f"MoD speed ({r.get('mod_impl')}, {r.get('compile')}): step s at {'/'.join(map(rate_key, RATES))}: "
            f"{steps}; executed {executed}; saved at 0.2 {_f(r.get('saved_0_2'))} vs 0.9*0.2*share "
            f"{_f(r.get('target_0_2'))} (skippable share {_f(r.get('skippable_share'))}): meets 0.9 "
            f"{r.get('meets_0_9')}; syncs/step {syncs}")
