"""`tools/gpu_check.sh --cpu`: the GPU check's sections at tiny size, with datasets, wandb and deepspeed hidden
from every import (as on the GPU machine). Every section's result lands in bench.json as it ends; a section that
fails or is killed at its limit records that, and the next sections still run."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

TRAIN = ("train_nag", "train_baseline", "train_nag_mod20")
CPU_SECTIONS = ("env", "data", *TRAIN, "mod_speed", "profile", "resume", "tests", "dcp")  # the GPU's order, less `install`
RATES = ("0", "0.2", "0.5")  # mod_speed's dialled skip rates (issue 59)
HIDDEN = ("datasets", "wandb", "deepspeed", "transformers", "lm_eval", "flash_attn", "megablocks", "grouped_gemm")


def gpu_check(repo_root, out, **env_extra):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(out), "OMP_NUM_THREADS": "1", **env_extra}
    proc = subprocess.run(["bash", os.path.join(repo_root, "tools/gpu_check.sh"), "--cpu"], cwd=repo_root,
                          env=env, capture_output=True, text=True, timeout=300)
    return proc, json.loads((out / "bench.json").read_text())


@pytest.mark.slow
def test_gpu_check_cpu_mode_records_every_section(repo_root, tmp_path):
    proc, bench = gpu_check(repo_root, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    sections = bench["sections"]
    assert list(sections) == list(CPU_SECTIONS)
    assert bench["cuda_rules"] == "2.11"  # every section under CUDA's autocast rules of the GPU machine's torch
    for name, s in sections.items():
        assert s["status"] == "ok", (name, s)
        assert 0 <= s["seconds"] <= s["limit"], (name, s)  # each section's time against its own limit
    assert bench["budget"] == 245 and sum(s["limit"] for s in sections.values()) <= bench["budget"]
    for name in TRAIN:
        c = sections[name]["result"]
        losses = c["losses"]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], (name, losses)
        assert c["compile"] in ("off", "on", "eager fallback") and c["grad_accum"] == 2
        assert c["tokens_per_s"] > 0 and 0 < c["mfu_vs_measured_matmul"] and c["memory_estimate_bytes"] > 0
        assert c["memory_estimate"]["source"] == "computed here" and c["memory_estimate"]["cuda_rules"] == "2.11"
        assert c["syncs_per_step"] is None and c["peak_memory_bytes"] is None  # CUDA-only readings
        assert c["precision"]["cuda_rules"] == "2.11" and c["backends"]["precision"].endswith("torch 2.11")
        assert c["kernel_contracts"] == {"grouped_mm_dtypes": [["bfloat16", "bfloat16"]], "violations": []}, name
        assert c["backends_ran"]["experts"] == {"grouped": 2} and "fallbacks" not in c["backends_ran"], name
        assert c["warnings"] == []
    mod = bench["comparison"]["mod"]
    assert 0 < mod["skip_rate"] < 1 and mod["charged_flop_ratio"] > 1 and mod["wall_clock_speedup"] > 0
    assert bench["comparison"]["nag_over_baseline_step_time"] > 0
    resume = sections["resume"]["result"]
    assert resume["resumed_at_step"] == 2 and resume["max_rel_diff_after_resume"] <= resume["tolerance"]
    assert resume["losses_resumed"] == pytest.approx(resume["losses_straight"], rel=resume["tolerance"])
    assert sections["env"]["result"]["hidden"] == list(HIDDEN)
    assert "aten::pow.Tensor_Scalar" in sections["env"]["result"]["autocast"]["cuda_registrations"]
    check_mod_speed(sections["mod_speed"]["result"], tmp_path)
    check_profile(sections["profile"]["result"], tmp_path, proc.stdout)
    assert "skipped" in sections["tests"]["result"]["summary"]  # the gpu tests were collected, then skipped
    assert (tmp_path / sections["dcp"]["result"]["metadata"]).is_file()
    assert "| train_nag_mod20 |" in proc.stdout and "NAG / baseline step time" in proc.stdout
    assert "resume           ok" in proc.stdout and " s of a 245 s budget" in proc.stdout
    assert "MoD speed (gather, off): step s at 0/0.2/0.5: " in proc.stdout  # the summary's mod_speed line


def check_mod_speed(r, out):
    """Issue 59's section on the CPU: gather MoD (the CPU default), each dialled rate timed, its host reads counted
    and profiled; the skippable share from rate 0's profile and the derived check recorded."""
    assert r["mod_impl"] == "gather" and r["backends"]["MoD.impl"] == "gather" and r["compile"] == "off"
    assert r["config"] == "configs/paper/nag-mod20-r40.yaml" and r["warmup_steps"] >= 2 and r["skipping_after_warmup"]
    assert list(r["rates"]) == list(RATES)
    for key, rate in r["rates"].items():
        assert rate["step_s"] > 0 and rate["micro_step_s"] > 0, (key, rate)
        assert len(rate["micro_step_s_all"]) == rate["micro_steps_per_step"] * r["timed_steps_per_rate"] == 4
        # gather: one host read per MoD sublayer and micro-step, the calibrator's and the metrics' read per step
        assert rate["syncs_per_step"] == 2 * 4 + 2 and rate["sync_sites"], (key, rate)
        assert rate["sync_error"] is None and rate["peak_bytes"] is None  # CUDA-only readings
        if key != "0":  # the CPU rehearsal profiles rate 0 only (the GPU every rate), and says so
            assert rate["profile"] is None and rate["profile_skipped"].startswith("cpu mode"), (key, rate)
            continue
        assert rate["profile"] == f"mod_speed_profile_{key}.txt", (key, rate.get("profile_skipped"))  # in time
        assert (out / rate["profile"]).is_file()
        assert "Self CPU time total" in (out / rate["profile"]).read_text()
    executed = [r["rates"][k]["executed_fraction"] for k in RATES]
    assert executed[0] == 1.0 and executed[2] < executed[1] < 1.0, executed  # the dial skips more at 0.5
    shares = r["skippable_share_by_sublayer"]
    assert set(shares) == {"CCAttention", "MoELayer"} and all(v > 0 for v in shares.values())
    assert 0 < r["skippable_backward_share"] < r["skippable_share"] < 1
    assert r["skippable_share"] == pytest.approx(sum(shares.values()))
    assert 0 < r["skippable_share_ops"] < 1
    assert r["saved_0_2"] == pytest.approx(1 - r["rates"]["0.2"]["step_s"] / r["rates"]["0"]["step_s"])
    assert r["target_0_2"] == pytest.approx(0.9 * 0.2 * r["skippable_share"])
    assert r["meets_0_9"] is (r["saved_0_2"] >= r["target_0_2"])


def check_profile(r, out, stdout):
    """Issue 60's section on the CPU: baseline-r40 and nag-r40 through the Trainer, each step's time split by region
    (every region that runs in these configs has time and launches), the optimizer timed apart, the kernel table."""
    assert r["paper_tokens_per_step"] == 512 and list(r["configs"]) == ["baseline", "nag"]
    for key, entry in r["configs"].items():
        after = entry["after"]
        assert after["compile"] == "off" and after["step_s"] > 0 and after["batch_tokens"] == 512, (key, after)
        assert 0 < after["optimizer_s"] < after["step_s"] and after["forward_backward_s"] > 0, (key, after)
        regions = after["regions"]
        for name in ("attention", "moe_gemm", "moe_glue", "loss", "optimizer", "stream"):
            assert regions[name]["s"] > 0 and regions[name]["launches"] > 0, (key, name, regions)
        assert regions["ffn"] == {"s": 0.0, "launches": 0}  # MoE configs: no dense MLP sublayer
        assert after["launches"] == sum(x["launches"] for x in regions.values())
        assert after["grouped_gemm_flops_per_s"] > 0 and after["mfu_vs_datasheet"] is None  # no data sheet on a CPU
        assert "Self CPU time total" in (out / after["profile"]).read_text()
    before = r["configs"]["nag"]["before"]  # the third variant: the code before issue 60 by its switches
    assert before["backends"]["loss"] == "eager, chunks recomputed" and before["step_s"] > 0, before
    assert before["restored"][:2] == ["metrics read before the step", "eager loss chunk, recomputed"]
    assert before["regions"]["optimizer"]["launches"] > 0 and (out / before["profile"]).is_file()
    last = r["configs"]["baseline"]["before"]  # the fourth: measured, or skipped for the limit and said so
    assert "step_s" in last or "s left of the limit, the last variant took" in last["skipped"], last
    assert "baseline/after step " in stdout and "nag/after step " in stdout and "nag/before step " in stdout


def test_mod_block_runs_by_name_only(repo_root, tmp_path):
    """mod_block left the default lists (mod_speed answers issue 59 through the Trainer); named, it still runs."""
    proc, bench = gpu_check(repo_root, tmp_path, GPU_CHECK_SECTIONS="mod_block")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert list(bench["sections"]) == ["mod_block"] and bench["sections"]["mod_block"]["status"] == "ok"
    assert bench["sections"]["mod_block"]["result"]["precision"]["compute_dtype"] == "bfloat16"


def test_a_failing_or_killed_section_leaves_the_others(repo_root, tmp_path):
    """`env` fails on purpose, `dcp` hangs and is killed at a 2 s limit; `data` between them still runs."""
    proc, bench = gpu_check(repo_root, tmp_path, GPU_CHECK_SECTIONS="env,data,dcp", GPU_CHECK_FAIL="env",
                            GPU_CHECK_HANG="dcp", GPU_CHECK_LIMIT_dcp="2")
    assert proc.returncode == 1, proc.stdout[-4000:]
    sections = bench["sections"]
    assert list(sections) == ["env", "data", "dcp"]
    assert sections["env"]["status"] == "failed"
    assert sections["env"]["error"] == "RuntimeError: deliberate failure (GPU_CHECK_FAIL=env)"
    assert sections["data"]["status"] == "ok" and sections["data"]["result"]["totals"]["train"]["n_tokens"] > 0
    assert sections["dcp"] == {"status": "timeout", "seconds": sections["dcp"]["seconds"], "limit": 2,
                               "error": "killed at its 2 s limit"}


def test_the_blocker_really_hides_the_optional_packages(repo_root, tmp_path):
    """The blocker the script installs makes the optional packages missing even where they are installed (datasets,
    wandb, deepspeed and transformers are, here): `import` raises ModuleNotFoundError and find_spec returns None,
    as for a package that is not there (on the parent the blocker raised from find_spec instead)."""
    script = open(os.path.join(repo_root, "tools/gpu_check.sh")).read()
    blocker = script.split("<<'PYEOF'\n", 1)[1].split("PYEOF\n", 1)[0]
    (tmp_path / "sitecustomize.py").write_text(blocker)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{repo_root}"}
    code = ("import importlib, importlib.util\nfor n in %r:\n"
            "    print('spec', n, importlib.util.find_spec(n))\n"
            "    try:\n        importlib.import_module(n)\n        print('imported', n)\n"
            "    except ModuleNotFoundError as e:\n        print('hidden', n, e)\n"
            "import yaml, tokenizers, numpy, nagmoe.train.trainer\n" % (HIDDEN,))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    want = [line for n in HIDDEN for line in (f"spec {n} None", f"hidden {n} No module named '{n}'")]
    assert proc.stdout.splitlines() == want
