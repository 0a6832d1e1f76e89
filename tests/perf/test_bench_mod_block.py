"""Issue 28's block benchmark (`tools/bench_mod.py --block`, tools/bench_mod_block.py) in its smoke size: both
sublayers skip the asked share of tokens, every rate gets a paired median speed-up inside its bootstrap interval,
the charged and the executed-with-padding FLOP ratios, the realised share and a verdict, and the profile table
by kind of op. A measurement, not a timed test: nothing here asserts a speed."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_block_benchmark_smoke_reports_every_field(tmp_path):
    out = tmp_path / "block.json"
    r = subprocess.run([sys.executable, "tools/bench_mod.py", "--block", "--smoke", "--threads", "1", "--profile", "1",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "mod_block" and result["smoke"] and result["device"] == "cpu"
    assert result["allocator"] == "caching" and result["timing"] == "process CPU time"  # glibc: mallopt took
    (row,) = result["rates"]
    assert row["skip_rate"] == 0.2
    assert all(abs(f - 0.8) < 0.02 for f in row["executed_fractions"])  # both sublayers skip ~20% of the tokens
    assert row["padded_attention_rows"] >= row["executed_fractions"][0]
    lo, hi = row["cpu_speedup_ci95"]
    assert lo <= row["cpu_speedup_median"] <= hi and len(row["cpu_speedup_per_repeat"]) == result["repeats"]
    assert row["charged_flop_ratio"] > 1 and row["executed_flop_ratio_with_padding"] <= row["charged_flop_ratio"]
    assert row["realised_share"] == (row["cpu_speedup_median"] - 1) / (row["charged_flop_ratio"] - 1)
    assert row["verdict"].startswith(("meets", "below"))
    kinds = {"experts", "scores", "projections", "gather/scatter", "masks", "NAG elementwise", "other"}
    assert set(result["profile_s_per_step"]) == {"skip 0%", "skip 20%"}
    assert all(set(t) == kinds for t in result["profile_s_per_step"].values())


def test_attention_kernel_benchmark_smoke_times_the_three_paths(tmp_path):
    """`--block --attention-kernels`: full causal attention, and the executed queries through the blocked SDPA
    and through the chunked CPU kernel (several chunks even at smoke size), as ratios to full causal."""
    out = tmp_path / "kernels.json"
    r = subprocess.run([sys.executable, "tools/bench_mod.py", "--block", "--attention-kernels", "--smoke", "--threads",
                        "1", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "mod_attention_kernels" and result["seq_len"] > result["chunk"]
    assert abs(result["executed_fraction"] - 0.8) < 0.02
    assert set(result["median_ratio_to_full_causal"]) == {"full causal", "blocked sdpa", "chunked"}
    assert result["median_ratio_to_full_causal"]["full causal"] == 1.0
    assert all(t > 0 for t in result["median_s"].values())
