"""The sections of tools/gpu_check/gpu_check.sh: one process per section, its result written into RESULTS/bench.json
as the section ends (an atomic rewrite), so a failing, killed or timed-out section leaves the others' results.

    python tools/gpu_check/gpu_check_sections.py init    --out DIR --mode gpu|cpu [--budget S]
    python tools/gpu_check/gpu_check_sections.py run     NAME --out DIR --work DIR --mode gpu|cpu [--limit S]
    python tools/gpu_check/gpu_check_sections.py record  NAME --out DIR --status timeout --seconds S --error TEXT
                                                         [--limit S]
    python tools/gpu_check/gpu_check_sections.py summary --out DIR

bench.json: {"mode", "date", "budget", "machine", "sections": {NAME: {"status": ok|failed|timeout|running,
"seconds", "limit", "result" and/or "error"}}, "comparison"}. `run` marks its section "running" first (a partial
"result" may follow), then ok or failed; `record` is the shell's word for a process that could not write its own
end (killed at its time limit, crashed): it replaces only a missing or "running" status. `summary` prints each
section's seconds against its limit and writes the comparisons across the training sections.
GPU_CHECK_FAIL=NAME[,NAME] makes those sections fail at their start, GPU_CHECK_HANG=NAME[,NAME] makes them hang
until the shell's limit kills them (the tests of this very recording).
The training sections are in tools/gpu_check/gpu_check_train.py, MoD's speed section (issue 59) in
tools/gpu_check/gpu_check_mod.py, the store in tools/gpu_check/gpu_check_common.py; this file holds the driver and
the short sections.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback

from gpu_check_common import BENCH, REPO, Ctx, SectionFailed, finite, load, one_line, put, save

# absent on the GPU machine (its image: torch, numpy, pyyaml, tokenizers, tqdm, pytest); tools/gpu_check/gpu_check.sh
# hides them here too, as not found (import fails with ModuleNotFoundError, importlib.util.find_spec returns None)
HIDDEN = ("datasets", "wandb", "deepspeed", "transformers", "lm_eval", "flash_attn", "megablocks", "grouped_gemm")


# ----------------------------------------------------------------------------------------------------------
# Short sections
# ----------------------------------------------------------------------------------------------------------
def section_install(ctx: Ctx) -> dict:
    # --use-pep517: an editable wheel built with this environment's setuptools. Without it pip ran `setup.py
    # develop`, whose setuptools shells out to a pip that fetches setuptools from the network (the GPU machine has
    # none: the first GPU run's install failed so). --no-index: no network to try.
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--use-pep517", "--no-index",
           "-e", REPO]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    sys.stdout.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    if proc.returncode:
        raise RuntimeError(f"pip install exited {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}")
    return {"command": " ".join(cmd[1:])}


def section_env(ctx: Ctx) -> dict:
    """The blocker is active, the package imports, what this machine has and, on a GPU, the real per-op autocast
    dtypes: saved the moment they are probed (a second of GPU work; the first answer only a GPU gives). Comparing
    them with nagmoe's CPU stand-in of those rules is offline work for a CPU:
    `python -m nagmoe.cuda_rules.probe --mode tier --rules 2.11 --compare bench.json`."""
    import importlib.util

    for name in HIDDEN:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as e:
            raise RuntimeError(f"find_spec({name!r}) raised {one_line(e)}: a missing package returns None") from e
        if found is not None:
            raise RuntimeError(f"{name} is importable: the blocker of tools/gpu_check/gpu_check.sh is not active")
    import torch

    import nagmoe.flops  # noqa: F401 (import check)
    import nagmoe.model  # noqa: F401
    import nagmoe.ops.nag_fused  # noqa: F401
    import nagmoe.train.trainer  # noqa: F401

    cuda = torch.cuda.is_available()
    ctx.note_machine(torch=torch.__version__, device=torch.cuda.get_device_name(0) if cuda else "cpu")
    autocast = {"cuda_registrations": sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))}
    ctx.partial({"autocast": autocast})
    if cuda:  # the ground truth for nagmoe/cuda_rules/table.py's table of this torch: per-op dtypes on the real GPU
        from nagmoe.cuda_rules.probe import probe

        t0 = time.time()
        autocast["dtype_probe"] = probe("cuda")
        autocast["dtype_probe_seconds"] = round(time.time() - t0, 2)
        ctx.partial({"autocast": autocast})
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "autocast": autocast, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
            "triton": importlib.util.find_spec("triton") is not None, "hidden": list(HIDDEN)}


def section_tests(ctx: Ctx) -> dict:
    """The gpu-marked tests under tests/gpu/ (by path: collecting the whole suite costs more than they do; their CPU
    stand-ins beside them run in the suite)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "-m", "gpu", "tests/gpu/"],
                          cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400"})  # the short summary keeps each error's words
    sys.stdout.write(proc.stdout[-6000:] + proc.stderr[-2000:])
    lines = proc.stdout.strip().splitlines()
    tail = lines[-1] if lines else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|xfailed)", tail)}
    # each failure's test and first line of its error (pytest's short summary), for the JSON
    failures = [line[:300] for line in lines if line.startswith(("FAILED ", "ERROR "))][:20]
    result = {"summary": tail, **counts, **({"failures": failures} if failures else {})}
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise SectionFailed(f"pytest tests/gpu/ exited {proc.returncode}: {tail}", result)
    return result


def section_dcp(ctx: Ctx) -> dict:
    """A DCP checkpoint written by this machine's torch, read back through the restricted unpickler; its
    .metadata is kept beside bench.json (a fixture for the checkpoint tests of another torch)."""
    import shutil

    import torch

    from nagmoe.checkpoint import load_checkpoint, save_checkpoint
    from nagmoe.checkpoint.safe_dcp import read_metadata_file
    from nagmoe.config import load_config
    from nagmoe.model import build_model

    # a CPU model: NAG's eager maths (auto is eager for CPU tensors too; said here so no compile can creep in)
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"),
                      ["model.d_model=32", "model.n_layers=1", "model.vocab_size=256", "model.nag.impl=eager"])
    model = build_model(cfg.model)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, 16))).loss.backward()
    optim.step()
    path = save_checkpoint(os.path.join(ctx.work, "dcp"), 1, model, optim)
    read_metadata_file(os.path.join(path, ".metadata"))
    fresh = build_model(cfg.model)
    load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()), restore_rng=False)
    kept = os.path.join(ctx.out, f"dcp-torch-{torch.__version__.split('+')[0]}.metadata")
    shutil.copyfile(os.path.join(path, ".metadata"), kept)
    return {"torch": torch.__version__, "metadata": os.path.basename(kept), "read_back": True}


def section_mod_block(ctx: Ctx) -> dict:
    """The MoD block benchmark's slot (issue 28): `tools/bench/bench_mod.py --block --out FILE` at the paper's
    micro-batch on the GPU, `--smoke` in --cpu mode; its JSON is this section's result."""
    path = os.path.join(ctx.work, "mod_block.json")
    cmd = [sys.executable, os.path.join(REPO, "tools/bench/bench_mod.py"), "--block", "--out", path]
    if ctx.mode == "cpu":
        cmd.append("--smoke")
    else:  # the paper's micro-batch (16 rows of 2048 per device): one row cannot fill a GPU; 3 paired repeats (10
        # did not finish in 45 s on the H200)
        cmd += ["--block-rows", "16", "--repeats", "3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    sys.stdout.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    if proc.returncode:
        raise RuntimeError(f"bench_mod.py --block exited {proc.returncode}: "
                           f"{(proc.stderr.strip().splitlines() or [''])[-1]}")
    with open(path) as f:
        return json.load(f)


def sections() -> dict:
    import gpu_check_mod as mod  # issue 59's MoD speed section (imports nothing of this file)
    import gpu_check_profile as profile  # issue 60's profile section (imports nothing of this file)
    import gpu_check_train as train  # the training sections (imports nothing of this file)

    return {"install": section_install, "data": train.section_data, **train.TRAIN_SECTIONS,
            "mod_speed": mod.section_mod_speed, "profile": profile.section_profile, "resume": train.section_resume, "mod_block": section_mod_block,
            "env": section_env, "tests": section_tests, "dcp": section_dcp}


# ----------------------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------------------
def cmd_init(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    save(args.out, {"mode": args.mode, "date": now.isoformat(timespec="seconds"), "budget": args.budget,
                    # --cpu: CUDA's autocast rules of this torch version on the CPU (gpu_check.sh sets it)
                    "cuda_rules": os.environ.get("NAGMOE_CUDA_RULES") or None,
                    "machine": {"platform": platform.platform(), "python": platform.python_version(),
                                "cpus": os.cpu_count()},
                    "sections": {}})
    return 0


def cmd_run(args) -> int:
    from gpu_check_train import Delegated

    ctx = Ctx(args.name, args.mode, args.out, args.work, args.limit, eager=args.eager)
    if not args.eager:  # the eager fallback keeps what its compiled try recorded (the compile error)
        put(args.out, args.name, {"status": "running", "limit": args.limit})
    fail, hang = ({s.strip() for s in os.environ.get(v, "").split(",")} for v in ("GPU_CHECK_FAIL", "GPU_CHECK_HANG"))
    if args.name in hang:  # until the shell's time limit kills it
        time.sleep(3600)
    entry = {}
    try:
        if args.name in fail:
            raise RuntimeError(f"deliberate failure (GPU_CHECK_FAIL={os.environ['GPU_CHECK_FAIL']})")
        result = sections()[args.name](ctx)
        entry = {"status": "ok", **({"result": result} if result else {})}
    except Delegated as e:  # the fresh eager process wrote this section's entry
        return e.rc
    except BaseException as e:  # noqa: BLE001 (every failure is recorded; KeyboardInterrupt too)
        traceback.print_exc()
        entry = {"status": "failed", "error": one_line(e),
                 "traceback": traceback.format_exc().strip().splitlines()[-12:]}
        old = load(args.out)["sections"].get(args.name, {})
        result = getattr(e, "result", None) or old.get("result")  # what was kept so far
        if result is not None:
            entry["result"] = result
    entry["seconds"] = round(time.time() - ctx.t0, 1)
    entry["limit"] = args.limit
    put(args.out, args.name, finite(entry))
    print(f"[gpu_check] {args.name}: {entry['status']}"
          + (f": {entry['error']}" if "error" in entry else ""), file=sys.stderr)
    return 0 if entry["status"] == "ok" else 1


def cmd_record(args) -> int:
    old = load(args.out)["sections"].get(args.name, {})
    entry = {"status": args.status, "seconds": args.seconds, "limit": args.limit, "error": args.error}
    if "result" in old:  # e.g. the configs a timed-out training section finished
        entry["result"] = old["result"]
    put(args.out, args.name, entry, only_open=True)
    return 0


def _fmt(v, spec=".3g"):
    return "-" if v is None else format(v, spec)


def cmd_summary(args) -> int:
    """Each section's status, seconds and limit (the budget's accounting), the training table, the
    comparisons across the training sections, also written into bench.json as "comparison", and mod_speed's line."""
    import gpu_check_train as train

    data = load(args.out)
    print(f"\n== summary ({data.get('mode')} mode): {os.path.join(args.out, BENCH)}")
    used = 0.0
    for name, s in data["sections"].items():
        note = s.get("error") or ""
        used += s.get("seconds") or 0
        print(f"{name:<16} {s.get('status', '?'):<8} {_fmt(s.get('seconds'), '.0f'):>4} s of {_fmt(s.get('limit'), '.0f'):>4}"
              f"  {note[:100]}")
    print(f"{'sections':<16} {used:.0f} s of a {_fmt(data.get('budget'), '.0f')} s budget")
    for w in data.get("machine", {}).get("warnings", []):
        print(f"WARNING: {w}")
    results = {n: s.get("result") for n, s in data["sections"].items() if n in train.TRAIN_SECTIONS}
    if results:
        print("\n| config | compile | tokens/s | step s | MFU 989T | MFU matmul | peak GiB | peak / estimate | "
              "syncs/step | loss first->last |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, c in results.items():
            status = data["sections"][name].get("status")
            if not c or "step_s_median" not in c:
                print(f"| {name} | {status}: {(data['sections'][name].get('error') or '')[:80]} |")
                continue
            peak = c.get("peak_memory_bytes")
            losses = c.get("losses") or [None]
            print(f"| {name} | {c.get('compile')} | {_fmt(c.get('tokens_per_s'), '.0f')} | "
                  f"{_fmt(c.get('step_s_median'), '.4f')} | {_fmt(c.get('mfu_vs_datasheet'), '.3f')} | "
                  f"{_fmt(c.get('mfu_vs_measured_matmul'), '.3f')} | {_fmt(peak and peak / 2**30, '.1f')} | "
                  f"{_fmt(c.get('peak_over_estimate'), '.2f')} | {_fmt(c.get('syncs_per_step'), 'd')} | "
                  f"{_fmt(losses[0], '.3f')}->{_fmt(losses[-1], '.3f')} |")
        comparison = train.compare(results)
        data["comparison"] = finite(comparison)
        save(args.out, data)
        print(f"NAG / baseline step time: {_fmt(comparison.get('nag_over_baseline_step_time'))}")
        mod = comparison.get("mod") or {}
        print(f"MoD: skip {_fmt(mod.get('skip_rate'))}, wall speed-up {_fmt(mod.get('wall_clock_speedup'))} vs "
              f"charged-FLOP ratio {_fmt(mod.get('charged_flop_ratio'))}: gain share "
              f"{_fmt(mod.get('gain_fraction_of_flop_gain'))}")
    prof = data["sections"].get("profile")
    if prof:  # issue 60's line: the r40 step at the paper's tokens per step, before and after
        import gpu_check_profile

        print(gpu_check_profile.summary_line(prof["result"]) if prof.get("result") else
              f"profile: {prof.get('status')}: {(prof.get('error') or '')[:100]}")
    speed = data["sections"].get("mod_speed")
    if speed:  # issue 59's line: the dialled rates' step times against the skippable share
        import gpu_check_mod

        print(gpu_check_mod.summary_line(speed["result"]) if speed.get("result") else
              f"MoD speed: {speed.get('status')}: {(speed.get('error') or '')[:100]}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("init", "run", "record", "summary"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        if name in ("run", "record"):
            p.add_argument("name")
        if name in ("init", "run"):
            p.add_argument("--mode", choices=("gpu", "cpu"), required=True)
        if name == "init":
            p.add_argument("--budget", type=float, default=None, help="the script's budget (s)")
        if name == "run":
            p.add_argument("--work", required=True)
            p.add_argument("--eager", action="store_true", help="a training section's eager fallback (internal)")
        if name in ("run", "record"):
            p.add_argument("--limit", type=float, default=None, help="the section's time limit (s)")
        if name == "record":
            p.add_argument("--status", choices=("timeout", "failed"), required=True)
            p.add_argument("--seconds", type=float, required=True)
            p.add_argument("--error", required=True)
    args = ap.parse_args(argv)
    return {"init": cmd_init, "run": cmd_run, "record": cmd_record, "summary": cmd_summary}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
