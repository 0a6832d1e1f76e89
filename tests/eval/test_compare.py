"""Paired comparisons on the strided eval sample (issue 66): the interval of `paired_difference` holds a difference
planted by hand and measured by another path; the pairing is by window id; `nagmoe compare` end to end (reuse of
kept window losses, fresh scoring of both checkpoints, bad input in one line)."""
import copy
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_process import nagmoe_cli as nagmoe_process

TOKENS = 2048  # 32 strided windows of the trained run's 434 val windows (seq_len 64)
HEAD_NOISE = 1.0  # std of the noise added to lm_head's weight: ~+0.06 bpb (measured), resolved by 32 windows


# ----------------------------------------------------------------------------------------------------------
# library level: a planted difference
# ----------------------------------------------------------------------------------------------------------
def planted(model):
    """A copy whose output head carries fixed-seed noise. Noise and not a scale: NAG decodes through the head's
    normalised rows (stream.decode_weight), and lm_head x3 moved bpb by 2e-9 when measured."""
    b = copy.deepcopy(model)
    with torch.no_grad():
        w = b.lm_head.weight
        w.add_(HEAD_NOISE * torch.randn(w.shape, generator=torch.Generator().manual_seed(0)))
    return b


def whole_sample_bpb(model, shards, seq_len, tb, **which):
    """bpb from whole-sample totals through the trainer's old path (bpb_sums per batch, float32 sums, batches of
    another size): independent of the per-window accumulation and of the pairing."""
    from nagmoe.data.bpb import bits_per_byte, bpb_sums
    from nagmoe.data.loader import iter_eval_windows

    nats, nbytes = 0.0, 0
    with torch.no_grad():
        for _, x, y in iter_eval_windows(shards, seq_len, 5, **which):
            n, b = bpb_sums(model(x, y, reduction="none").loss, y, tb)
            nats, nbytes = nats + n, nbytes + b
    return bits_per_byte(nats, nbytes)


@pytest.fixture(scope="module")
def lib(trained_run):
    """The trained run's model A, its planted copy B, the strided sample and both runs' window losses on it."""
    from nagmoe.data.bpb import token_bytes
    from nagmoe.data.eval_sample import eval_window_ids
    from nagmoe.data.loader import TokenShards
    from nagmoe.eval.generate import load_run
    from nagmoe.eval.val_windows import score_windows

    torch.set_num_threads(1)
    cwd = os.getcwd()
    os.chdir(trained_run)  # its config names the data dir relative to the folder
    try:
        run = load_run("run", "cpu")
        seq_len, data_dir = run.config.data.seq_len, os.path.abspath(run.config.data.data_dir)
    finally:
        os.chdir(cwd)
    shards, tb = TokenShards(data_dir, "val"), token_bytes(data_dir)
    ids = eval_window_ids(int(shards.window_starts(seq_len)[-1]), TOKENS, seq_len, "strided")
    model_b = planted(run.model)

    def score(model, window_ids):
        return score_windows(model, shards, seq_len, window_ids, 8, tb)

    sample = dict(max_tokens=TOKENS, sample="strided")
    delta = (whole_sample_bpb(model_b, shards, seq_len, tb, **sample)
             - whole_sample_bpb(run.model, shards, seq_len, tb, **sample))
    return dict(model_a=run.model, model_b=model_b, ids=ids, score=score, shards=shards, seq_len=seq_len, tb=tb,
                a=score(run.model, ids), b=score(model_b, ids), delta=delta)


def test_the_paired_interval_holds_a_planted_difference_and_excludes_zero(lib):
    from nagmoe.analysis.paired import paired_difference

    delta = lib["delta"]
    assert delta > 0.02  # the noise really worsens the model (not undone by a normalisation)
    d = paired_difference([(lib["a"], lib["b"])])
    lo, hi = d["ci95_bpb"]
    assert d["windows"] == len(lib["ids"]) == TOKENS // lib["seq_len"]
    assert 0 < lo < delta < hi, (d, delta)
    assert d["difference_bpb"] == pytest.approx(delta, abs=1e-5)  # the ratio of sums is the totals' difference
    assert d["resolves_bpb"] == pytest.approx((hi - lo) / 2) and d["resolves_bpb"] < delta
    # A and B swapped: the difference and its interval negated
    r = paired_difference([(lib["b"], lib["a"])])
    assert r["difference_bpb"] == pytest.approx(-d["difference_bpb"], abs=1e-12)
    assert r["ci95_bpb"] == pytest.approx([-hi, -lo], abs=1e-12)
    assert (r["reference_bpb"], r["variant_bpb"]) == pytest.approx((d["variant_bpb"], d["reference_bpb"]))


def test_two_identical_models_give_an_interval_of_zero_width_around_zero(lib):
    from nagmoe.analysis.paired import paired_difference

    again = lib["score"](copy.deepcopy(lib["model_a"]), lib["ids"])
    lo, hi = paired_difference([(lib["a"], again)])["ci95_bpb"]
    assert lo <= 0.0 <= hi and hi - lo < 1e-9


def test_windows_pair_by_id_never_by_position(lib):
    """B scored on other windows does not pair with A; on a half-shifted sample only the common windows pair, and
    their difference is the planted one measured on those windows alone. Pairing by position would pair every
    window of the shifted sample and mix windows of the half-shifted one."""
    from nagmoe.analysis.paired import NotPaired, paired_difference

    ids, score = lib["ids"], lib["score"]
    with pytest.raises(NotPaired, match="no common windows"):
        paired_difference([(lib["a"], score(lib["model_b"], ids + 1))])
    mixed = ids.copy()
    mixed[1::2] += 1  # strided ids are ~13 apart: still ascending, and none of A's
    d = paired_difference([(lib["a"], score(lib["model_b"], mixed))])
    common = dict(window_ids=ids[::2])
    delta_common = (whole_sample_bpb(lib["model_b"], lib["shards"], lib["seq_len"], lib["tb"], **common)
                    - whole_sample_bpb(lib["model_a"], lib["shards"], lib["seq_len"], lib["tb"], **common))
    assert d["windows"] == len(ids[::2])
    assert d["difference_bpb"] == pytest.approx(delta_common, abs=1e-5)
    assert d["ci95_bpb"][0] < delta_common < d["ci95_bpb"][1]


# ----------------------------------------------------------------------------------------------------------
# `nagmoe compare`
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def pair(trained_run, tmp_path, monkeypatch):
    """tmp_path holding config.yaml, data/ and two copies of the trained run, run_a/ and run_b/ (the cwd)."""
    shutil.copytree(os.path.join(trained_run, "data"), tmp_path / "data")
    shutil.copy(os.path.join(trained_run, "config.yaml"), tmp_path)
    for name in ("run_a", "run_b"):
        shutil.copytree(os.path.join(trained_run, "run"), tmp_path / name)
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    return tmp_path


@pytest.fixture
def loads(monkeypatch):
    """The run dirs `load_run` was called for (the real one runs)."""
    import nagmoe.eval.generate as generate

    seen, real = [], generate.load_run

    def spy(run_dir, *a, **k):
        seen.append(run_dir)
        return real(run_dir, *a, **k)

    monkeypatch.setattr(generate, "load_run", spy)
    return seen


def compare(capsys, *argv):
    """(exit code, stdout, stderr, the --json written or None) of `nagmoe compare ARGV` in this process."""
    from nagmoe.cli import main

    capsys.readouterr()
    code = main(["compare", *map(str, argv), "--device", "cpu", "--json", "out.json"])
    out, err = capsys.readouterr()
    written = json.loads(Path("out.json").read_text()) if code == 0 else None
    if os.path.exists("out.json"):
        os.remove("out.json")
    return code, out, err, written


def edit_kept(run_dir, **changes):
    """Rewrite RUN_DIR/eval_windows.json: `nats_times` scales every window's nats (the sample's fingerprint does
    not cover the losses, so the file still reads cleanly); other keys are set as given."""
    path = os.path.join(run_dir, "eval_windows.json")
    obj = json.loads(Path(path).read_text())
    factor = changes.pop("nats_times", 1.0)
    obj["nats"] = [v * factor for v in obj["nats"]]
    obj.update(changes)
    Path(path).write_text(json.dumps(obj))


def one_error(code, err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_the_same_run_twice_differs_by_exactly_zero(pair):
    """End to end in a process of its own, on a sample other than the kept one: both checkpoints scored."""
    done = nagmoe_process("compare", "run_a", "run_b", "--tokens", str(TOKENS), "--device", "cpu", "--json", "out.json",
                          cwd=pair)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    out = json.loads((pair / "out.json").read_text())
    assert out["difference_bpb"] == 0.0 and out["ci95_bpb"] == [0.0, 0.0] and out["resolves_bpb"] == 0.0
    assert out["reused"] is False and out["tokens_per_s"] > 0 and out["windows"] == 32 and out["method"] == "delta"
    assert out["run_a"] == str(pair / "run_a") and out["reference_bpb"] == out["variant_bpb"]
    text = done.stdout
    assert "scoring both latest checkpoints on 32 strided windows" in text and "tokens/s" in text
    assert "on 32 windows, 2,048 tokens" in text and "95% interval [+0.0000, +0.0000]" in text
    assert "verdict: not resolved by these windows" in text


def test_current_kept_losses_are_reused_and_no_model_is_loaded(pair, capsys, monkeypatch):
    """B's kept losses planted 1% worse: the printed difference is the kept files' one, and no model is loaded
    (load_run and score_windows would fail the test); --tokens naming the kept sample reuses too."""
    import nagmoe.eval.generate as generate
    import nagmoe.eval.val_windows as val_windows
    from nagmoe.analysis.paired import paired_difference

    def refuse(*a, **k):
        raise AssertionError("a model was loaded or scored")

    monkeypatch.setattr(generate, "load_run", refuse)
    monkeypatch.setattr(val_windows, "score_windows", refuse)
    edit_kept("run_b", nats_times=1.01)
    kept = [val_windows.read_window_losses(d) for d in ("run_a", "run_b")]
    expected = paired_difference([tuple(kept)])
    for extra in ([], ["--tokens", 1024], ["--sample", "strided"]):  # 1024: train.eval_tokens, as kept
        code, out, err, written = compare(capsys, "run_a", "run_b", *extra)
        assert code == 0, err[-3000:]
        assert ("reused the kept window losses (eval_windows.json of steps 2 and 2, strided sample): no model "
                "loaded") in out
        assert written["reused"] is True and written["tokens_per_s"] is None
        assert written["difference_bpb"] == pytest.approx(expected["difference_bpb"], rel=1e-12)
        assert written["difference_bpb"] > 0.02 and "verdict: B behind A by" in out


@pytest.mark.parametrize("breakage", ["stale", "malformed", "other sample"])
def test_both_runs_are_scored_fresh_unless_both_kept_files_are_current(pair, capsys, loads, breakage):
    """A's kept losses planted 1% worse and current: had compare mixed A's kept file with B's fresh score, the
    difference of the two identical checkpoints would not be exactly 0."""
    edit_kept("run_a", nats_times=1.01)
    extra = []
    if breakage == "stale":
        edit_kept("run_b", step=1)  # the latest checkpoint is of step 2
    elif breakage == "malformed":
        (pair / "run_b" / "eval_windows.json").write_text('{"format": "nagmoe.eval_windows", "version": 1, "nats":')
    else:
        extra = ["--sample", "first"]
    code, out, err, written = compare(capsys, "run_a", "run_b", *extra)
    assert code == 0, err[-3000:]
    assert sorted(loads) == ["run_a", "run_b"]
    assert written["reused"] is False and written["difference_bpb"] == 0.0 and written["ci95_bpb"] == [0.0, 0.0]
    assert "scoring both latest checkpoints" in out and "tokens/s" in out
    ignored = [ln for ln in (out + err).splitlines() if "ignored" in ln]
    if breakage == "malformed":
        assert len(ignored) == 1 and "RUN_B" in ignored[0] and "Traceback" not in err, out + err
    else:
        assert ignored == []
    if breakage == "stale":
        assert "B's kept losses are of step 1, its latest checkpoint of step 2" in out


def other_data(root):
    """data2/: the data with the val shard cut to its first half (a valid index, another val fingerprint)."""
    shutil.copytree(root / "data", root / "data2")
    index = json.loads((root / "data2" / "index.json").read_text())
    rec = next(r for r in index["shards"] if r["split"] == "val")
    tokens = np.fromfile(root / "data2" / rec["file"], dtype=rec["dtype"])[: rec["n_tokens"] // 2]
    os.remove(root / "data2" / rec["file"])
    rec["sha256"] = hashlib.sha256(tokens.tobytes()).hexdigest()
    rec["file"], rec["n_tokens"] = f"val-00000-{rec['sha256'][:12]}.bin", len(tokens)
    index["totals"]["val"]["n_tokens"] = len(tokens)
    tokens.tofile(root / "data2" / rec["file"])
    (root / "data2" / "index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("change", ["seq_len", "data"])
def test_runs_of_other_windows_are_refused_in_one_line(pair, capsys, loads, change):
    config = pair / "run_b" / "config.yaml"
    text = config.read_text()
    if change == "seq_len":
        assert "\n  seq_len: 64\n" in text
        config.write_text(text.replace("\n  seq_len: 64\n", "\n  seq_len: 32\n"))
    else:
        other_data(pair)
        assert "\n  data_dir: data\n" in text
        config.write_text(text.replace("\n  data_dir: data\n", "\n  data_dir: data2\n"))
    code, out, err, _ = compare(capsys, "run_a", "run_b")
    line = one_error(code, err)
    assert "RUN_A run_a" in line.replace("'", "") and "RUN_B run_b" in line.replace("'", "")
    assert ("seq_len 64" in line and "seq_len 32" in line) if change == "seq_len" else "data" in line
    assert loads == []


def test_bad_input_is_one_line_exit_2(pair, capsys):
    os.makedirs("empty")
    shutil.copytree("run_b", "no_checkpoint")
    shutil.rmtree("no_checkpoint/checkpoints")
    cases = {"must be >= 1": ["run_a", "run_b", "--tokens", 0],
             "needs 2 or more": ["run_a", "run_b", "--tokens", 64],  # one window: no spread to measure
             "is not a directory": ["run_a", "missing"],
             "is not a run dir": ["empty", "run_b"],
             "no valid checkpoint": ["run_a", "no_checkpoint"]}
    for expected, argv in cases.items():
        code, _, err, _ = compare(capsys, *argv)
        assert expected in one_error(code, err), err
