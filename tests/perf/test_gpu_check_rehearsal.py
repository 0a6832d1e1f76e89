"""The GPU machine's run of `tools/gpu_check/gpu_check.sh`, rehearsed on the CPU (issue 52): the script in GPU mode (the
GPU's sizes, limits and section order), with only the GPU image's packages importable (the script's own blocker)
and a stand-in GPU host (tests/perf/gpu_host/sitecustomize.py): `torch.cuda.is_available()` is True and the device
answers as an H200, so every section takes its CUDA branches, but the first CUDA work raises `CudaWorkReached`.

What it holds: each section's host-side work (imports, data, configs, the committed estimates, the eager fallback's
fresh process, the autocast probe's host side, the DCP round trip of a CPU model, pytest's start) ends within its
limit, with the CUDA initialisation and cold compiles the limit must also cover still to come. A section either
finishes (work with no GPU part) or stops at its GPU work, never at its limit. On the parent of issue 52 `env`
(its CPU tier probe), the training sections (the eager fallback re-estimating memory at paper width, with NAG
compiled for the CPU) and `dcp` (NAG compiled for a CPU model) ran out their limits here.

Not rehearsed: `install` (pip into this environment), and Python 3.12 (no torch wheel for it here; the estimates'
fingerprint test runs under every installed interpreter instead).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SECTIONS = ("env", "data", "train_nag", "train_baseline", "train_nag_mod20", "mod_speed", "profile", "resume", "tests",
            "dcp")
# the Trainer, with the eager fallback
TRAIN = ("train_nag", "train_baseline", "train_nag_mod20", "mod_speed", "profile", "resume")
HOST_ONLY = ("env", "data", "dcp")  # sections that finish with no CUDA work of their own
REACHED = "CudaWorkReached"
# what torch's C++ says where CUDA work bypasses the Python lazy init (pinned memory): GPU work too
NO_ACCELERATOR = "Cannot access accelerator device when none is available"


def rehearse(repo_root, tmp_path) -> tuple[subprocess.CompletedProcess, dict, list]:
    """Runs the script as the GPU machine would, every Python process on the stand-in host; returns the process,
    bench.json and [(pid, host seconds before its first CUDA work, command)]."""
    python = tmp_path / "python"  # the script's $PYTHON: the stand-in leads the path of every process it starts
    python.write_text(f'#!/bin/bash\nexport PYTHONPATH="{HERE}/gpu_host${{PYTHONPATH:+:$PYTHONPATH}}"\n'
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "reached.tsv"
    env = {**os.environ, "PYTHON": str(python), "GPU_CHECK_OUT": str(out), "GPU_REHEARSAL_LOG": str(log),
           "GPU_CHECK_SECTIONS": ",".join(SECTIONS)}
    for var in ("NAGMOE_CUDA_RULES", "CUDA_VISIBLE_DEVICES", "GPU_CHECK_BUDGET"):
        env.pop(var, None)
    proc = subprocess.run(["bash", os.path.join(repo_root, "tools/gpu_check/gpu_check.sh")], cwd=repo_root, env=env,
                          capture_output=True, text=True, timeout=420)
    reached = []
    if log.exists():
        for line in log.read_text().splitlines():
            pid, seconds, command = line.split("\t", 2)
            reached.append((int(pid), float(seconds), command))
    return proc, json.loads((out / "bench.json").read_text()), reached


@pytest.mark.slow
def test_every_section_reaches_its_gpu_work_within_its_limit(repo_root, tmp_path):
    proc, bench, reached = rehearse(repo_root, tmp_path)
    sections = bench["sections"]
    report = "\n".join(f"{n:<16} {s['status']:<8} {s.get('seconds')} s of {s.get('limit')}  {s.get('error') or ''}"
                       for n, s in sections.items())
    print(f"\nrehearsal (host-side seconds against each limit):\n{report}")
    context = report + "\n" + proc.stdout[-3000:]
    assert bench["mode"] == "gpu" and set(sections) == set(SECTIONS), context
    for name, s in sections.items():
        assert s["status"] != "timeout" and s["seconds"] <= s["limit"], (name, context)
        if name in HOST_ONLY:
            assert s["status"] == "ok", (name, context)
        elif name != "tests":
            assert s["status"] == "failed" and REACHED in s["error"], (name, context)

    assert list(sections) == list(SECTIONS), context  # the answers only a GPU gives first

    # the first answer only a GPU gives, saved: the per-op autocast dtypes (here from fake CUDA tensors)
    autocast = sections["env"]["result"]["autocast"]
    assert autocast["dtype_probe"]["mm"]["low"] == "bfloat16" and "tier_disagrees" not in autocast
    assert sections["env"]["result"]["hidden"] == ["datasets", "wandb", "deepspeed", "transformers", "lm_eval",
                                                   "flash_attn", "megablocks", "grouped_gemm"]
    # the training sections: the compiled try's error in the JSON, then the eager fallback in a fresh process
    # (its own pid in the log of CUDA work reached), its memory refusal on the committed estimate
    for name in TRAIN:
        result = sections[name]["result"]
        assert result["compile"] == "eager fallback" and REACHED in result["compile_error"], (name, result)
        processes = [r for r in reached if f" run {name} " in r[2] + " "]
        assert [" --eager " in r[2] + " " for r in processes] == [False, True], (name, processes)
        assert all(seconds < sections[name]["limit"] / 2 for _, seconds, _ in processes), (name, processes)
    # pytest in the tests section: every failure is its GPU work (a real failure would name another error)
    failures = sections["tests"]["result"].get("failures", [])
    assert all(REACHED in f or NO_ACCELERATOR in f for f in failures) and sections["tests"]["seconds"] < sections["tests"]["limit"] / 2, (
        failures)
    # the limits against the budget: tests/perf/test_gpu_check_estimates.py::test_the_gpu_sections_fit_the_budget
    assert bench["budget"] == 590 and "s of a 590 s budget" in proc.stdout
