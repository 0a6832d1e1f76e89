"""The training sections of tools/gpu_check/gpu_check.sh (run through tools/gpu_check/gpu_check_sections.py), all
through the real `nagmoe.train.trainer.Trainer`:

  data             script-made token shards (no network, no `datasets`): documents of phrases drawn from a
                   Zipf-weighted phrase bank whose ids are Zipf-distributed, so the loss falls within a few steps; a
                   word-level tokenizer.json of exactly the vocabulary (the trainer's bits-per-byte needs one).
  train_baseline,  configs/paper/{baseline,nag,nag-mod20}-r40.yaml at parallel.ep=1, one section (process) each so a
  train_nag,       hang or crash in one leaves the others their time; compile caches shared on disk between them
  train_nag_mod20  (gpu_check.sh sets TORCHINDUCTOR_CACHE_DIR); train.batch_tokens=65536, 8 steps driven one
                   `train_step` at a time (no eval, no checkpoint): tokens/s (median of the steady steps), MFU
                   against the data sheet and a bf16 matmul measured here, peak memory beside the committed memory
                   estimate (gpu_check_estimates.json, computed on a CPU under CUDA's rules of this torch),
                   host syncs per step (torch.cuda.set_sync_debug_mode("warn") over the last step; CPU: null) and
                   their sites, the losses; MoD's realised skip rate. `compare` (the summary) sets NAG against the
                   baseline and MoD's wall-clock speed-up against its FLOP gain.
  resume           a 4-layer nag-mod20-r40: 4 steps straight, and 2 steps then a resume to 4 (run dirs,
                   checkpoints and metrics.jsonl as `nagmoe train` writes them): the per-step losses must match.
`train.compile` is the config's; when compiling fails, the compile error is written into bench.json at once and
the config runs again eager (train.compile=false model.nag.impl=eager) in a fresh process within what is left of
the section's limit, recorded as "eager fallback" with the error; on CUDA its memory refusal takes the committed
estimate (estimating at paper width costs minutes of host CPU). After every step the steps so far are written
(a section killed at its limit keeps them); the bf16 matmul peak is measured after the training.
On a GPU other than sm90/sm100 (H100/H200, B200) a warning is
recorded: `torch._grouped_mm` has its fast kernel there only; elsewhere it loops over the experts with a host sync
per call. --cpu mode: the same at tiny width (d_model 64, 2 layers, vocabulary 512), the estimate computed here.
"""
from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import time
import traceback

from gpu_check_common import REPO, SectionFailed, load, one_line, put
from gpu_check_configs import PAPER, SIZES, micro_batch_tokens, overrides, paper_config


# ----------------------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------------------
def section_data(ctx) -> dict:
    s = SIZES[ctx.mode]
    return make_data(os.path.join(ctx.work, "data"), s["vocab"], s["data_tokens"])


def make_data(root: str, vocab: int, n_tokens: int, seed: int = 0) -> dict:
    import numpy as np
    from tokenizers import Tokenizer, models

    from nagmoe.data import shards
    from nagmoe.data.tokenizer import BOS, file_sha256, save_tokenizer, token_dtype

    shutil.rmtree(root, ignore_errors=True)
    part = os.path.join(root, "stage", shards.part_dir_name(0, 1))
    os.makedirs(part)
    tok = Tokenizer(models.WordLevel({BOS: 0, **{f"t{i}": i for i in range(1, vocab)}}, unk_token=BOS))
    tok.add_special_tokens([BOS])
    tok_path = os.path.join(root, "stage", "tokenizer.json")
    save_tokenizer(tok, tok_path)
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, vocab) ** 1.1
    ids = rng.permutation(np.arange(1, vocab))  # frequency rank -> token id
    bank = [ids[rng.choice(vocab - 1, size=int(rng.integers(4, 17)), p=zipf / zipf.sum())] for _ in range(4096)]
    bank_p = 1.0 / np.arange(1, len(bank) + 1)
    bank_p /= bank_p.sum()
    dtype = token_dtype(vocab)
    writers = {sp: shards.ShardWriter(part, sp, dtype, 1 << 22) for sp in shards.SPLITS}
    for split, n in (("train", n_tokens), ("val", max(n_tokens // 16, 8192))):
        while writers[split].n_tokens < n:
            doc = [np.zeros(1, dtype=dtype)] + [bank[i] for i in rng.choice(len(bank), size=256, p=bank_p)]
            writers[split].add_document(np.concatenate(doc).astype(dtype))
    shards.write_part_index(part, writers, vocab_size=vocab, bos_id=0, tokenizer_sha256=file_sha256(tok_path),
                            corpus="gpu_check synthetic", documents="Zipf phrases", val_fraction=1 / 17,
                            text_field="text")
    index = shards.merge_parts(os.path.join(root, "data"), [part], tok_path, verify=False)
    return {"data_dir": os.path.join(root, "data"), "vocab_size": vocab, "totals": index["totals"]}


# ----------------------------------------------------------------------------------------------------------
# shared
# ----------------------------------------------------------------------------------------------------------
def data_dir(ctx) -> str:
    return os.path.join(ctx.work, "data", "data")


def compiles(cfg, device) -> bool:
    from nagmoe.train.speed import resolve_compile  # the trainer's own reading of train.compile (auto: CUDA)

    return resolve_compile(cfg.train.compile, device.type)


def fresh_dir(ctx, name: str) -> str:
    path = os.path.join(ctx.work, "runs", name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


EAGER = ["train.compile=false", "model.nag.impl=eager"]  # the fallback: nothing compiled, NAG's eager maths too


class Delegated(Exception):
    """The section's answer was written by the fresh process its eager fallback ran in (exit code `rc`)."""

    def __init__(self, rc: int):
        super().__init__(f"eager fallback exited {rc}")
        self.rc = rc


def with_eager_fallback(ctx, cfg_for, run, device) -> dict:
    """run(extra overrides, run-dir suffix) with the config's train.compile. If that compiles and fails, the
    compile error goes into bench.json at once, and the config runs again eager (EAGER) in a fresh process: a
    sticky CUDA error can poison this one, and dynamo's state with it. That process (`ctx.eager`, started by
    `eager_in_fresh_process`) writes the section's entry itself. cfg_for(extra) loads the config."""
    if ctx.eager:
        said = {"compile": "eager fallback", "compile_error": os.environ.get("GPU_CHECK_COMPILE_ERROR")}
        ctx.partial(said)  # should the eager run fail too, the entry says which try it was
        return {**said, **run(EAGER, "-eager")}
    from nagmoe.base.errors import UserError

    if not compiles(cfg_for([]), device):
        return {"compile": "off", **run([], "")}
    try:
        return {"compile": "on", **run([], "")}
    except UserError:  # a config or data error fails eager alike: no rerun
        raise
    except Exception as e:  # noqa: BLE001 (any other failure under compile earns the eager try)
        traceback.print_exc()
        error = one_line(e)
    ctx.partial({"compile": "on", "compile_error": error})  # kept whatever the fallback does
    raise Delegated(eager_in_fresh_process(ctx, error))


def eager_in_fresh_process(ctx, error: str) -> int:
    """Runs this section again with `--eager` in a new process, within what is left of its limit; returns its
    exit code. A fallback killed here leaves its partial results and a timeout status."""
    import subprocess
    import sys

    left = ctx.seconds_left()
    cmd = [sys.executable, os.path.join(REPO, "tools", "gpu_check", "gpu_check_sections.py"), "run", ctx.name,
           "--eager", "--out", ctx.out, "--work", ctx.work, "--mode", ctx.mode]
    if ctx.limit is not None:
        cmd += ["--limit", f"{ctx.limit:g}"]
    print(f"[gpu_check] {ctx.name}: compiled run failed ({error}); eager fallback in a fresh process", flush=True)
    try:
        env = {**os.environ, "GPU_CHECK_COMPILE_ERROR": error, "GPU_CHECK_T0": repr(ctx.t0)}
        return subprocess.run(cmd, env=env, timeout=None if left is None else max(left - 3, 1)).returncode
    except subprocess.TimeoutExpired:
        entry = load(ctx.out)["sections"].get(ctx.name, {})
        put(ctx.out, ctx.name, {**entry, "status": "timeout", "error": f"eager fallback killed at the "
                                f"section's limit (compile error: {error})"})
        return 124


FAST_GROUPED_MM = (9, 10)  # compute capability majors where torch._grouped_mm has its kernel: sm90 (H100/H200), sm100


def grouped_mm_warning(name: str, capability: tuple) -> list[str]:
    """A warning for a GPU where `torch._grouped_mm` has no fast kernel (none on sm90 / sm100)."""
    major, minor = capability
    if major in FAST_GROUPED_MM:
        return []
    return [f"{name} is sm{major}{minor}: torch._grouped_mm has its fast kernel on sm90/sm100 only; here the MoE "
            "experts loop with a host sync per call (tokens/s and syncs not representative)"]


def device_info():
    """(device, name, data-sheet peak FLOP/s, warnings)."""
    import torch

    from nagmoe.flops import peak_flops

    if not torch.cuda.is_available():
        return torch.device("cpu"), "cpu", None, []
    name = torch.cuda.get_device_name(0)
    warnings = grouped_mm_warning(name, torch.cuda.get_device_capability(0))
    return torch.device("cuda"), name, peak_flops(name) or 989e12, warnings  # H200 bf16 dense: 989 TFLOP/s


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_flops(device, n: int) -> dict:
    """FLOP/s of an n^3 matmul (bf16 on CUDA, fp32 on CPU): the reachable peak of this machine."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(13):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return {"n": n, "dtype": str(dtype), "flops_per_s": 2 * n ** 3 / statistics.median(times)}


# ----------------------------------------------------------------------------------------------------------
# train_r40
# ----------------------------------------------------------------------------------------------------------
def dynamo_counts() -> dict:
    """Graphs dynamo compiled and graph breaks so far (recompiles show as more graphs)."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def one_step(trainer) -> dict:
    return trainer.train_step()  # the step's metrics (router load included) in one host read


def counted_syncs(fn):
    """(fn(), syncs, {file:line: count}): CUDA's sync debug mode warns once per synchronizing call."""
    import warnings
    from collections import Counter

    import torch

    sync(torch.device("cuda"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    hits = [w for w in caught if "synchroniz" in str(w.message)]
    sites = Counter(f"{os.path.relpath(w.filename, REPO)}:{w.lineno}" for w in hits)
    return out, len(hits), dict(sites.most_common(12))


def memory_estimate(key: str, cfg, device) -> dict:
    """GPU: the committed estimate of this config under CUDA's rules of this torch
    (tools/gpu_check/gpu_check_estimates.py; its probes take about a minute of CPU, not lease time); CPU: computed
    here (tiny width, a second)."""
    import torch

    from nagmoe.cuda_rules.table import version_key
    from nagmoe.train.memory import estimate_memory

    if device.type == "cuda":
        from gpu_check_estimates import lookup

        return {"source": "committed", **lookup(key, cfg, version_key(torch.__version__))}
    est = estimate_memory(cfg, ep=1, micro_batch_tokens=micro_batch_tokens(cfg), device="cpu", world_size=1)
    return {"source": "computed here", "bytes": est["total"], "cuda_rules": est["layout"]["cuda_rules"]}


def ahead_estimate(estimate: dict, cfg, device):
    """The Trainer's `eager_memory_estimate` from the committed estimate, on CUDA: eager, its memory refusal (0 when
    there is none: unchecked); compiled, the loss's keep-or-recompute plan (None when there is none: the trainer
    estimates, a minute of host CPU)."""
    if device.type != "cuda":
        return None
    return estimate.get("bytes") or estimate.get("bytes_when_computed") or (None if compiles(cfg, device) else 0)


def train_config(ctx, key: str, cfg, run_dir: str, s: dict, device, peak) -> dict:
    """Trains `cfg` s["steps"] steps one `train_step` at a time; after each step the rows so far go into bench.json
    (`ctx.partial`), so a section killed at its limit keeps the compile time and every step it timed."""
    import torch

    from nagmoe.cuda_rules.contracts import KernelContracts
    from nagmoe.flops import flops_per_token
    from nagmoe.train.trainer import Trainer

    estimate = memory_estimate(key, cfg, device)
    free_memory()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else None  # what an earlier config left
    ahead = ahead_estimate(estimate, cfg, device)
    trainer = Trainer(cfg, run_dir, eager_memory_estimate=ahead)  # not quiet: device, backends, accumulation logged
    rows, syncs, sites, dynamo0 = [], None, None, dynamo_counts()
    contracts = None  # compiled: the kernels (and their meta functions in the trace) check for themselves
    try:
        for i in range(s["steps"]):
            flops0 = trainer.progress.flops
            sync(device)
            t0 = time.perf_counter()
            if device.type == "cuda" and i == s["steps"] - 1:  # the last step: counted, not timed
                rec, syncs, sites = counted_syncs(lambda: one_step(trainer))
            elif i == 0 and not trainer.compiled:  # the first (untimed) step: the kernels' dtype contracts
                with KernelContracts() as checked:
                    rec = one_step(trainer)
                contracts = {"grouped_mm_dtypes": sorted(set(checked.grouped_mm_dtypes)),
                             "violations": checked.violations[:5]}
                if checked.violations:
                    raise SectionFailed(f"kernel contract broken: {checked.violations[0]}", {})
            else:
                rec = one_step(trainer)
            sync(device)
            executed = rec.get("flops_executed")  # MoD: cumulative, as executed (padding included)
            rows.append({"s": time.perf_counter() - t0, "loss": float(rec["loss"]),
                         "charged": trainer.progress.flops - flops0,
                         "executed": None if executed is None else executed - sum(r["executed"] for r in rows),
                         "skip": rec.get("skip_rate"), "skip_tokens": rec.get("skip_rate_tokens"),
                         "fractions": rec.get("executed_fractions")})
            ctx.partial({"config": key, "compile": "eager" if not trainer.compiled else "on",
                         "steps_done": len(rows), "step_s": [r["s"] for r in rows],
                         "losses": [r["loss"] for r in rows], "memory_estimate": estimate})
    finally:
        trainer.release_lease()
    timed = rows[s["timed_from"] - 1: s["steps"] - (device.type == "cuda")]
    step_s = statistics.median(r["s"] for r in timed)
    bt, T = cfg.train.batch_tokens, cfg.data.seq_len
    fractions = None
    if timed[0]["fractions"] is not None:
        fractions = [statistics.mean(f) for f in zip(*(r["fractions"] for r in timed))]
    fpt = flops_per_token(cfg.model, T, fractions, "matmul")
    achieved = fpt * bt / step_s
    losses = [r["loss"] for r in rows]
    out = {"backends": trainer.backends, "grad_accum": trainer.accum, "batch_tokens": bt,
           "step_s": [r["s"] for r in rows], "timed_steps": [s["timed_from"], s["timed_from"] + len(timed) - 1],
           "step_s_median": step_s, "tokens_per_s": bt / step_s, "train_flops_per_token_matmul": fpt,
           "achieved_flops_per_s": achieved, "mfu_vs_datasheet": achieved / peak if peak else None,
           "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
           "peak_reserved_bytes": torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
           "allocated_before_bytes": before,
           "dynamo": {k: v - dynamo0[k] for k, v in dynamo_counts().items()},
           "precision": trainer.precision.describe(), "kernel_contracts": contracts,
           "backends_ran": trainer.backends_ran,
           "memory_estimate": estimate, "memory_estimate_bytes": estimate.get("bytes"),
           "peak_over_estimate": (torch.cuda.max_memory_allocated() / estimate["bytes"]
                                  if device.type == "cuda" and estimate.get("bytes") else None),
           "syncs_per_step": syncs, "sync_sites": sites, "losses": losses,
           "loss_finite": all(math.isfinite(x) for x in losses), "loss_falling": losses[-1] < losses[0]}
    if fractions is not None:  # MoD: what the trainer's accounting says the steady steps skipped and cost
        conv = cfg.train.flop_convention
        out["mod"] = {"skip_rate": statistics.mean(r["skip"] for r in timed),
                      "skip_rate_tokens": statistics.mean(r["skip_tokens"] for r in timed),
                      "executed_fractions": fractions, "flop_convention": conv,
                      "full_depth_flops_per_token": flops_per_token(cfg.model, T, None, conv),
                      "charged_flops_per_token": statistics.mean(r["charged"] / bt for r in timed),
                      "executed_flops_per_token": statistics.mean(r["executed"] / bt for r in timed)}
    return out


def train_section(key: str):
    """The section that trains configs/paper/<PAPER[key]>.yaml (module docstring)."""

    def section(ctx) -> dict:
        import torch

        s = SIZES[ctx.mode]
        device, name, peak, warnings = device_info()
        ctx.note_machine(torch=torch.__version__, device=name, **({"warnings": warnings} if warnings else {}))
        for w in warnings:
            print(f"WARNING: {w}", flush=True)

        def cfg_for(extra):
            return paper_config(key, ctx.mode, data_dir(ctx), extra)

        res = with_eager_fallback(ctx, cfg_for, lambda extra, suffix: train_config(
            ctx, key, cfg_for(extra), fresh_dir(ctx, key + suffix), s, device, peak), device)
        free_memory()
        # the reachable bf16 peak after the training answer (a second of GPU time; the Trainer's answer first)
        matmul = matmul_flops(device, s["matmul_n"])
        res["mfu_vs_measured_matmul"] = res["achieved_flops_per_s"] / matmul["flops_per_s"]
        result = {"config": f"configs/paper/{PAPER[key]}.yaml", "device": name, "torch": torch.__version__,
                  "datasheet_peak_flops": peak, "matmul": matmul, "steps": s["steps"], "warnings": warnings,
                  "overrides": overrides(ctx.mode, data_dir(ctx)), **res}
        print(f"{key}: { {k: res.get(k) for k in ('compile', 'tokens_per_s', 'losses')} }", flush=True)
        if not (res["loss_finite"] and res["loss_falling"]):
            raise SectionFailed(f"{key}: losses {'not finite' if not res['loss_finite'] else 'not falling'} "
                                f"{res['losses']}", result)
        return result

    return section


TRAIN_SECTIONS = {f"train_{key}": train_section(key) for key in PAPER}


def compare(results: dict) -> dict:
    """From the train sections' results ({section name: result}): NAG / baseline step time, and MoD's wall-clock
    speed-up against the FLOP gain the trainer charged (the share of the FLOP gain realised)."""
    ok = {name[len("train_"):]: r for name, r in results.items() if r and "step_s_median" in r}
    out = {}
    if "nag" in ok and "baseline" in ok:
        out["nag_over_baseline_step_time"] = ok["nag"]["step_s_median"] / ok["baseline"]["step_s_median"]
    if "nag" in ok and "nag_mod20" in ok and ok["nag_mod20"].get("mod"):
        mod = ok["nag_mod20"]["mod"]
        speedup = ok["nag"]["step_s_median"] / ok["nag_mod20"]["step_s_median"]
        charged = mod["full_depth_flops_per_token"] / mod["charged_flops_per_token"]
        out["mod"] = {"skip_rate": mod["skip_rate"], "wall_clock_speedup": speedup, "charged_flop_ratio": charged,
                      "executed_flop_ratio": mod["full_depth_flops_per_token"] / mod["executed_flops_per_token"],
                      "gain_fraction_of_flop_gain": (speedup - 1) / (charged - 1) if charged > 1 else None}
    return out


# ----------------------------------------------------------------------------------------------------------
# resume
# ----------------------------------------------------------------------------------------------------------
def step_losses(run_dir: str) -> dict:
    from nagmoe.rundir.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))}


def resume_config(mode: str, data: str, extra=()):
    """The resume section's model: 4 layers of nag-mod20-r40, an injection warm-up of one step (the first half
    of the run, n // 2 steps, must pass it: the config refuses a warm-up as long as the run)."""
    s = SIZES[mode]
    return paper_config("nag_mod20", mode, data, ["model.n_layers=4", f"model.nag.warmup_tokens={s['batch_tokens']}",
                                                  *extra])


def resume_configs(cfg_for, n: int) -> dict:
    """{steps: config} of the resume's runs (n straight, n // 2 then n), all loaded (validated) before any GPU
    work: at the GPU's size a config error once surfaced only after the first run (issue 52's GPU run)."""
    return {steps: cfg_for([f"train.max_steps={steps}"]) for steps in (n, n // 2)}


def resume_runs(ctx, cfg_for, n: int, suffix: str, device) -> dict:
    from nagmoe.train.trainer import Trainer

    configs = resume_configs(cfg_for, n)
    # eager on CUDA: no refusal estimate (minutes of host CPU at paper width); 4 layers of r40 take a few GiB
    ahead = 0 if device.type == "cuda" and not compiles(configs[n], device) else None

    def trainer(steps, run_dir):
        return Trainer(configs[steps], run_dir, quiet=True, eager_memory_estimate=ahead)

    straight, chained = fresh_dir(ctx, "straight" + suffix), fresh_dir(ctx, "chained" + suffix)
    trainer(n, straight).run()
    ctx.partial({"losses_straight": list(step_losses(straight).values())})
    trainer(n // 2, chained).run()
    free_memory()
    resumed = trainer(n, chained)
    resumed_at = resumed.progress.step
    resumed.run()
    return {"resumed_at_step": resumed_at, "straight": step_losses(straight), "chained": step_losses(chained)}


def section_resume(ctx) -> dict:
    s = SIZES[ctx.mode]
    device = device_info()[0]
    n = s["resume_steps"]

    def cfg_for(extra):
        return resume_config(ctx.mode, data_dir(ctx), extra)

    res = with_eager_fallback(ctx, cfg_for, lambda extra, suffix: resume_runs(
        ctx, lambda more: cfg_for([*extra, *more]), n, suffix, device), device)
    a, b = res.pop("straight"), res.pop("chained")
    rel = {step: abs(b[step] - a[step]) / max(abs(a[step]), 1e-12) for step in a if step in b}
    after = [rel[k] for k in rel if k > res["resumed_at_step"]]
    result = {**res, "config": "configs/paper/nag-mod20-r40.yaml + model.n_layers=4", "steps": n,
              "losses_straight": [a[k] for k in sorted(a)], "losses_resumed": [b[k] for k in sorted(b)],
              "max_rel_diff_before_resume": max((rel[k] for k in rel if k <= res["resumed_at_step"]), default=None),
              "max_rel_diff_after_resume": max(after, default=None), "tolerance": s["tolerance"]}
    if res["resumed_at_step"] != n // 2 or len(after) != n - n // 2 or max(after) > s["tolerance"]:
        raise SectionFailed(f"resumed at step {res['resumed_at_step']}: losses {result['losses_resumed']} vs "
                            f"straight {result['losses_straight']} (tolerance {s['tolerance']})", result)
    return result
