"""`nagmoe analyze` on the shared micro run (NAG, CCA, MoE): strict JSON with every section, statistics that agree
with each other, and exit 2 with one line for bad input."""
import json
import math

import pytest

from test_eval_command import _one_error_line, run_command


def _strict(constant):
    raise ValueError(f"non-standard JSON constant {constant}")


def test_analyze_writes_every_section(micro_run, tmp_path, capsys):
    out = tmp_path / "analysis.json"
    assert run_command("analyze", ["--run-dir", micro_run, "--out", str(out), "--tokens", "1024", "--bins", "4"]) == 0
    printed = capsys.readouterr().out
    assert "attention on BOS" in printed and str(out) in printed
    a = json.loads(out.read_text(), parse_constant=_strict)
    assert (a["residual"], a["attention"], a["ffn"], a["windows"]) == ("nag", "cca", "moe", "bos_aligned")
    assert a["tokens"] == 1024 and a["val_loss"] > 0 and a["val_bpb"] > 0

    depth = a["depth"]
    n = a["n_sublayers"]
    assert len(depth["norm_curve"]) == len(depth["cumulative_rotation"]) == n + 1 and len(depth["sublayers"]) == n
    assert depth["norm_curve"] == pytest.approx([math.exp(s) for s in depth["log_norm_curve"]])
    assert all(b >= a_ for a_, b in zip(depth["cumulative_rotation"], depth["cumulative_rotation"][1:]))
    for row in depth["sublayers"]:
        assert 0 <= row["dead_frac"] <= 1 and 0 <= row["on_frac"] <= 1 and row["gain_mean"] >= 0
        assert 0 < row["rotation"] <= math.atan(abs(row["alpha"])) + 1e-4  # NAG: angle = arctan(g) <= arctan(alpha)

    sink = a["attention_sink"]
    assert len(sink["first_key_mass_per_layer"]) == a["n_layers"]
    assert all(0 < v < 1 for v in sink["first_key_mass_per_layer"])
    assert 0 <= sink["layers_above_half"] <= a["n_layers"]

    conf = a["confidence"]
    assert set(conf) == {"entropy", "final_log_norm"}
    for rep in conf.values():
        assert len(rep["bins"]) == 4 and sum(b["tokens"] for b in rep["bins"]) == 1024
        assert -1 <= rep["spearman_loss"] <= 1
    mean_final = sum(b["mean"] * b["tokens"] for b in conf["final_log_norm"]["bins"]) / 1024
    assert mean_final == pytest.approx(depth["log_norm_curve"][-1], rel=1e-4)
    assert a["mod"] == "not available" or isinstance(a["mod"], dict)


@pytest.mark.parametrize("args, needle", [
    (["--out", "/no/such/dir/a.json"], "/no/such/dir"),
    (["--out", "OUT", "--tokens", "0"], "--tokens"),
])
def test_analyze_bad_input_exits_2(micro_run, tmp_path, capsys, args, needle):
    args = [str(tmp_path / "a.json") if a == "OUT" else a for a in args]
    assert run_command("analyze", ["--run-dir", micro_run, *args]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)


def test_analyze_missing_run_dir_exits_2(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert run_command("analyze", ["--run-dir", missing, "--out", str(tmp_path / "a.json")]) == 2
    assert missing in _one_error_line(capsys.readouterr().err)
