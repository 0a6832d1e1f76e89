"""`tools/gpu_check/gpu_check.sh --cpu`: the GPU check's sections at tiny size, with datasets, wandb and deepspeed
hidden from every import (as on the GPU machine). Every section's result lands in bench.json as it ends; a section that
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


LEASE = ("env", "data", "train_nag", "train_nag_mod20", "mod_speed")  # --lease: one 15-minute lease's list


def gpu_check(repo_root, out, *flags, **env_extra):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(out), "OMP_NUM_THREADS": "1", **env_extra}
    proc = subprocess.run(["bash", os.path.join(repo_root, "tools/gpu_check/gpu_check.sh"), "--cpu", *flags],
                          cwd=repo_root, env=env, capture_output=True, text=True, timeout=330)
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
    assert bench["budget"] == 285 and sum(s["limit"] for s in sections.values()) <= bench["budget"]
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
    assert "resume           ok" in proc.stdout and " s of a 285 s budget" in proc.stdout
    assert "MoD speed (static, off): MoD/NAG step at 0/0.2/0.5: " in proc.stdout  # the summary's mod_speed line


def check_mod_speed(r, out):
    """Issues 59 and 69's section on the CPU: NAG and static MoD (the GPU's implementation, named here: the CPU's
    auto is gather) in one process, 8 timed steps per phase, each dialled rate settled then pinned, host reads
    counted, rate 0 profiled (the shares), and the answer derived from them."""
    assert r["mod_impl"] == "static" and r["backends"]["MoD.impl"] == "static" and r["compile"] == "off"
    assert r["config"] == "configs/paper/nag-mod20-r40.yaml" and r["skipping_after_warmup"]
    assert r["nag"]["config"] == "configs/paper/nag-r40.yaml" and r["timed_steps"] == 8
    assert list(r["rates"]) == list(RATES)
    for key, phase in [("nag", r["nag"]), *r["rates"].items()]:
        assert len(phase["step_s_all"]) == 8 and phase["step_s"] > 0 and phase["micro_step_s"] > 0, (key, phase)
        assert len(phase["micro_step_s_all"]) == phase["micro_steps_per_step"] * 8 == 16, (key, phase)
        # static: no read per MoD sublayer; the metrics' read per step (and MoD's calibrator's)
        assert phase["syncs_per_step"] == (1 if key == "nag" else 2), (key, phase["sync_sites"])
        assert phase["dynamo"] == {"unique_graphs": 0, "graph_breaks": 0}, (key, phase)  # nothing compiled here
        assert phase["sync_error"] is None and phase["peak_bytes"] is None  # CUDA-only readings
        assert all(math.isfinite(x) for x in phase["losses"]), (key, phase["losses"])
    rates = [r["rates"][k] for k in RATES]
    assert rates[0]["executed_fraction"] == 1.0 and rates[0]["moe_skip"] == 0.0 and rates[0]["settle_skips"] == []
    assert 0 < rates[1]["skip_rate_work"] < rates[2]["skip_rate_work"] < 1, rates  # the dial skips more at 0.5
    assert rates[1]["moe_skip"] <= rates[2]["moe_skip"] and rates[2]["moe_skip"] > 0
    assert [len(x["settle_skips"]) for x in rates[1:]] == [2, 2]
    assert all(len(x["skip_rate_work_all"]) == 8 for x in rates)  # each timed step's skip at pinned thresholds
    for key, rate in r["rates"].items():
        if key != "0":  # the CPU rehearsal profiles rate 0 only (the GPU every rate), and says so
            assert rate["profile"] is None and rate["profile_skipped"].startswith("cpu mode"), (key, rate)
            continue
        assert rate["profile"] == "mod_speed_profile_0.txt", rate.get("profile_skipped")  # in time
        assert "Self CPU time total" in (out / rate["profile"]).read_text() and rate["launches"] > 0
    assert 0 < r["share_experts"] < r["share_eligible"] < 1
    assert r["share_experts"] == r["rates"]["0"]["regions"]["moe_gemm"]
    at = r["answer"]["0.2"]
    assert r["mod20_over_nag"] == pytest.approx(r["rates"]["0.2"]["step_s"] / r["nag"]["step_s"])
    assert r["saved_0_2"] == at["saved"] == pytest.approx(1 - r["rates"]["0.2"]["step_s"] / r["rates"]["0"]["step_s"])
    assert at["target_experts"] == pytest.approx(r["rates"]["0.2"]["moe_skip"] * r["share_experts"])
    assert at["target_eligible"] == pytest.approx(r["rates"]["0.2"]["skip_rate_work"] * r["share_eligible"])
    assert r["meets_0_9"] is (r["saved_0_2"] >= 0.9 * at["target_experts"])
    assert r["dynamo_section"] == {"unique_graphs": 0, "graph_breaks": 0}


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


@pytest.mark.slow
def test_the_lease_list_answers_mod_against_nag_within_its_budget(repo_root, tmp_path):
    """`--lease` (issue 69): the sections one 15-minute lease runs, in order, each within its limit, the limits
    within the list's budget; mod_speed's answer complete."""
    proc, bench = gpu_check(repo_root, tmp_path, "--lease")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    sections = bench["sections"]
    assert list(sections) == list(LEASE) and bench["budget"] == 145
    assert sum(s["limit"] for s in sections.values()) == 145
    for name, s in sections.items():
        assert s["status"] == "ok" and 0 <= s["seconds"] <= s["limit"], (name, s)
    check_mod_speed(sections["mod_speed"]["result"], tmp_path)
    assert "MoD speed (static, off): MoD/NAG step at 0/0.2/0.5: " in proc.stdout


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
    script = open(os.path.join(repo_root, "tools/gpu_check/gpu_check.sh")).read()
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
