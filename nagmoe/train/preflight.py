"""A preflight of a layout (issue 27): what a team checks on the cluster before queueing the real run, in one
short job at the real layout (`nagmoe launch slurm --preflight`; every rank runs `nagmoe preflight`).

Per rank: an all-reduce and an all-to-all bandwidth probe (bus bandwidth, GB/s), then `steps` training steps of
the real model through the Trainer in DIR/run (the config at DIR/slurm/config.yaml), a save, a resume in a
fresh Trainer that trains one more step, and the peak memory (CUDA: max allocated; CPU: peak RSS). Rank 0
writes DIR/summary.json and prints a one-screen verdict: each check PASS or FAIL, with the memory estimate
(nagmoe/train/memory.py) of the layout against the device's memory (or `--gpu-memory` in CPU mode, where the
estimate is the CUDA one: what the cluster's GPUs would need) — a layout that cannot fit is named with the
keys that change it.

A MoD config (model.mod.skip_rate > 0, issue 67) is measured as it will run once skipping has started, not at
full depth: `model.mod.start_tokens` and `model.nag.warmup_tokens` (skipping waits for the larger, 300M tokens in
the paper configs) are pinned to 0, and one forward of the first micro-batch (not a training step: the loader is
put back, the calibrator's token counts zeroed) fills the score histograms, so the thresholds of the config's
target rate hold from the first step. After the save and resume, the resumed MoD model and the same config at
full depth (skip_rate 0, in DIR/run-full-depth) each take the same measured steps outside the trainer's loop (no
metrics line, eval or save in them). Summary `mod` and `full_depth`: measured_steps, step_s (median after the
first step, which pays compilation), tokens_per_s, peak_memory (CUDA: max allocated over those steps, max over
ranks; None on the CPU, whose peak RSS covers the process's whole life); `mod` also target_skip, realised_skip
(the work-weighted skip over those steps) and pinned. A check fails when MoD did not skip from the first step.
"""
from __future__ import annotations

import copy
import gc
import json
import os
import resource
import shutil
import statistics
import time
from typing import Optional

import torch

from nagmoe.config import load_config, set_key
from nagmoe.config.flops import mfu
from nagmoe.rundir.names import CONFIG_FILE, METRICS_FILE, PREFLIGHT_RUN_DIR, SLURM_DIR, SUMMARY_FILE
from nagmoe.base.files import atomic_writer

PROBE_BYTES = {"cuda": 256 * 2 ** 20, "cpu": 8 * 2 ** 20}
FULL_DEPTH_RUN_DIR = "run-full-depth"  # beside PREFLIGHT_RUN_DIR: the MoD config's full-depth twin


def _bandwidth(op: str, device: torch.device, repeats: int = 5) -> Optional[float]:
    """Bus bandwidth in GB/s of an all-reduce or an all-to-all of PROBE_BYTES (None in one process)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world = dist.get_world_size()
    n = PROBE_BYTES[device.type] // 4 // world * world
    x = torch.ones(n, device=device)
    out = torch.empty_like(x)
    run = (lambda: dist.all_reduce(x)) if op == "all_reduce" else (lambda: dist.all_to_all_single(out, x))
    run()  # warm-up (connections)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / repeats
    factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world  # nccl-tests' bus bw
    return n * 4 * factor / seconds / 1e9


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gather(value, world: int) -> list:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def _prime_mod(trainer) -> None:
    """MoD skipping from the first step (module docstring): one forward of the first micro-batch in training
    mode fills the score histograms (summed over ranks), the calibrator sets the target rate's thresholds and
    turns skipping on; the loader is put back and the calibrator's token counts zeroed (no step was taken)."""
    from nagmoe.data.host_copy import to_device

    cal = trainer.model.mod_calibrator()
    state = trainer.loader.state_dict()
    x, y = next(trainer.loader)
    trainer.loader.load_state_dict(state)
    x, y = to_device(x, trainer.device), to_device(y, trainer.device)
    # the bare model (DDP's wrapper expects a backward), DeepSpeed's engine where it owns the weights; with
    # gradients on, as in training (a no_grad forward would compile its own graphs on CUDA)
    model = trainer.engine if trainer.engine is not None else trainer.model
    with trainer.precision.scope(), trainer.autocast:
        out = model(x, y)
    del out
    trainer.model.mod_update(trainer._sum_over_ranks if trainer.mesh.distributed else None)
    for buf in (cal.tokens_seen, cal.executed_total, cal.tokens_total):
        buf.zero_()
    cal.last_step = None


def _measure(trainer, steps: int, world: int) -> dict:
    """`steps` optimizer steps of `trainer` outside its loop, its garbage collection as in the loop: rank 0's
    median step time after the first (the first pays compilation and warm-up; the only one when steps == 1),
    the work-weighted skip of the steps, the peak memory over them (CUDA; max over ranks)."""
    from nagmoe.train.gc_control import LoopGC

    device = trainer.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, skips = [], []
    try:
        with LoopGC(trainer.cfg.train.gc_every) as loop_gc:
            for _ in range(steps):
                t0 = time.perf_counter()
                rec = trainer.train_step()  # ends with the step's metrics read: the device has finished
                times.append(time.perf_counter() - t0)
                skips.append(rec.get("skip_rate", 0.0))
                loop_gc.step_done(trainer.progress.step)
    finally:
        close = getattr(trainer.loader, "close", None)  # a prefetching loader's thread
        if close is not None:
            close()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    peaks = _gather(peak, world)
    step_s = statistics.median(times[1:] or times)
    return {"measured_steps": steps, "step_s": step_s, "tokens_per_s": trainer.cfg.train.batch_tokens / step_s,
            "peak_memory": None if peak is None else max(peaks), "skips": skips}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_preflight(directory: str, steps: int = 3, gpu_memory_gb: Optional[float] = None) -> Optional[dict]:
    """Run this rank's part (module docstring); the summary on rank 0, None elsewhere."""
    import torch.distributed as dist

    from nagmoe.train.memory import estimate_memory
    from nagmoe.rundir.metrics import read_metrics
    from nagmoe.train.trainer import Trainer

    cfg = load_config(os.path.join(directory, SLURM_DIR, CONFIG_FILE))
    for key, value in (("train.max_steps", steps), ("train.checkpoint_every", steps), ("train.eval_every", 0),
                       ("train.eval_tokens", cfg.data.seq_len), ("train.eval_tokens_during", cfg.data.seq_len),
                       ("log.every", 1), ("log.wandb", "off")):
        set_key(cfg, key, value)
    mod_on = cfg.model.mod.skip_rate > 0
    pinned = None
    if mod_on:  # skipping from the first step (module docstring)
        pinned = {"model.mod.start_tokens": cfg.model.mod.start_tokens,
                  "model.nag.warmup_tokens": cfg.model.nag.warmup_tokens}
        for key in pinned:
            set_key(cfg, key, 0)
    run_dir = os.path.join(directory, PREFLIGHT_RUN_DIR)
    full_dir = os.path.join(directory, FULL_DEPTH_RUN_DIR)
    if not dist.is_initialized() or dist.get_rank() == 0:  # each preflight starts from nothing
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(full_dir, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    trainer = Trainer(cfg, run_dir, quiet=True)
    device, world, rank = trainer.device, trainer.world_size, trainer.rank
    bandwidth = {op: _bandwidth(op, device) for op in ("all_reduce", "all_to_all")}
    if mod_on:
        _prime_mod(trainer)
    trainer.run()
    train_s = time.perf_counter() - t0
    records = [r for r in read_metrics(os.path.join(run_dir, METRICS_FILE)) if "step" in r] if rank == 0 else []
    saved_step = trainer.progress.step
    tokens = trainer.micro_rows * cfg.data.seq_len  # what each rank ran per micro-step
    step_flops = trainer.step_flops()
    del trainer  # its model and optimizer state are not the resumed run's memory
    _free(device)
    set_key(cfg, "train.max_steps", steps + 1)
    t1 = time.perf_counter()
    resumed = Trainer(cfg, run_dir, quiet=True)
    resumed_from = resumed.progress.step
    load_s = time.perf_counter() - t1
    resumed.run()
    ended_at = resumed.progress.step
    peak = _peak_memory(device)
    peaks = _gather(peak, world)
    mod = full = None
    if mod_on:  # the resumed MoD model, then the same config at full depth: the same measured steps
        measured = max(steps, 3)  # steps beside the first, which pays compilation
        mod = _measure(resumed, measured, world)
        del resumed
        _free(device)
        full_cfg = copy.deepcopy(cfg)
        set_key(full_cfg, "model.mod.skip_rate", 0.0)
        twin = Trainer(full_cfg, full_dir, quiet=True)
        try:
            full = _measure(twin, measured, world)
        finally:
            twin.release_lease()
        full.pop("skips")
        skips = mod.pop("skips")
        mod.update(target_skip=cfg.model.mod.skip_rate, realised_skip=sum(skips) / len(skips), pinned=pinned)
    if rank != 0:
        return None
    est_here = estimate_memory(cfg, cfg.parallel.ep, tokens, device.type, world)["total"]
    est_cuda = est_here if device.type == "cuda" else estimate_memory(cfg, cfg.parallel.ep, tokens, "cuda", world)["total"]
    capacity = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                else (gpu_memory_gb * 1e9 if gpu_memory_gb else None))
    last = records[-1] if records else {}
    step_s = cfg.train.batch_tokens / last["tokens_per_s"] if last.get("tokens_per_s") else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    util = mfu(step_flops / step_s, name, world) if step_s else None
    summary = {
        "layout": {"world_size": world, "ep": cfg.parallel.ep, "device": device.type, "device_name": name,
                   "micro_batch_tokens": tokens, "batch_tokens": cfg.train.batch_tokens},
        "steps": [{"step": r["step"], "loss": r["loss"], "tokens_per_s": r["tokens_per_s"],
                   **({"skip_rate": r["skip_rate"]} if "skip_rate" in r else {})} for r in records],
        "tokens_per_s": last.get("tokens_per_s"), "mfu": util, "train_and_save_s": round(train_s, 1),
        "resume": {"saved_step": saved_step, "resumed_from": resumed_from, "ended_at": ended_at,
                   "load_s": round(load_s, 1)},
        "bandwidth_gb_s": bandwidth,
        "memory": {"peak_per_rank": peaks, "estimate_here": est_here, "estimate_cuda": est_cuda,
                   "device_capacity": capacity},
        "mod": mod, "full_depth": full,
    }
    summary["checks"] = _checks(summary, records)
    summary["verdict"] = "PASS" if all(c["ok"] for c in summary["checks"]) else "FAIL"
    with atomic_writer(os.path.join(directory, SUMMARY_FILE)) as f:  # nagmoe.base.files
        json.dump(summary, f, indent=1)
    return summary


def _checks(summary: dict, records: list) -> list:
    import math

    mem, res = summary["memory"], summary["resume"]
    losses = [r["loss"] for r in records]
    checks = [
        {"name": "training steps", "ok": bool(losses) and all(math.isfinite(v) for v in losses),
         "detail": f"{len(losses)} steps, losses {', '.join(f'{v:.3f}' for v in losses)}"},
        {"name": "save and resume", "ok": res["resumed_from"] == res["saved_step"] and
         res["ended_at"] == res["saved_step"] + 1,
         "detail": f"saved step {res['saved_step']}, resumed from {res['resumed_from']} to {res['ended_at']} "
                   f"(load {res['load_s']} s)"},
    ]
    need, cap = mem["estimate_cuda"], mem["device_capacity"]
    fits = cap is None or need <= cap
    checks.append({"name": "memory fits", "ok": fits,
                   "detail": (f"estimate {need / 1e9:.1f} GB per rank vs {cap / 1e9:.1f} GB" if cap else
                              f"estimate {need / 1e9:.1f} GB per rank (no device size given)") +
                   ("" if fits else ": the layout does not fit; lower train.micro_batch_tokens, turn on "
                    "train.activation_checkpointing, set model.moe.capacity_factor or use more ranks")})
    worst = max(p for p in mem["peak_per_rank"] if p is not None)
    checks.append({"name": "measured peak vs estimate", "ok": worst <= 1.3 * mem["estimate_here"],
                   "detail": f"peak {worst / 1e9:.2f} GB, estimate {mem['estimate_here'] / 1e9:.2f} GB "
                             f"({summary['layout']['device']})"})
    mod = summary.get("mod")
    if mod is not None:  # MoD skips from the first step, at about its target, in the measured steps
        first = records[0].get("skip_rate", 0.0) if records else 0.0
        pinned = ", ".join(f"{k} {v:,}" for k, v in mod["pinned"].items() if v)
        checks.append({"name": "MoD skips", "ok": first > 0 and mod["realised_skip"] > 0,
                       "detail": f"target {mod['target_skip']:g}: skip {first:.3f} at step 1, "
                                 f"{mod['realised_skip']:.3f} over {mod['measured_steps']} measured steps"
                                 + (f" ({pinned} pinned to 0)" if pinned else "")})
    return checks


def format_verdict(summary: dict) -> str:
    lay, bw = summary["layout"], summary["bandwidth_gb_s"]
    lines = [f"nagmoe preflight: {summary['verdict']} — {lay['world_size']} rank(s), ep {lay['ep']}, "
             f"{lay['device_name']}, micro-batch {lay['micro_batch_tokens']:,} tokens"]
    for c in summary["checks"]:
        lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['detail']}")
    tps, util = summary["tokens_per_s"], summary["mfu"]
    lines.append(f"  info  throughput: {tps:,.0f} tokens/s, MFU {'-' if util is None else f'{100 * util:.1f}%'}"
                 if tps else "  info  throughput: -")
    lines.append("  info  bus bandwidth: " + ", ".join(
        f"{op} {'-' if v is None else f'{v:.2f} GB/s'}" for op, v in bw.items()))
    mod, full = summary.get("mod"), summary.get("full_depth")
    if mod is not None and full is not None:
        def speed(m: dict) -> str:
            peak = "-" if m["peak_memory"] is None else f"{m['peak_memory'] / 1e9:.2f} GB"
            return f"{m['step_s']:.3f} s/step ({m['tokens_per_s']:,.0f} tokens/s), peak {peak}"

        lines.append(f"  info  MoD at skip {mod['realised_skip']:.3f} (target {mod['target_skip']:g}): {speed(mod)}")
        ratio = mod["step_s"] / full["step_s"]
        lines.append(f"  info  full depth, the same model: {speed(full)}; MoD's step {ratio:.2f}x"
                     + ("" if full["peak_memory"] is not None else " (CPU: no per-run peak memory)"))
    return "\n".join(lines)
