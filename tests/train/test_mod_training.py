"""MoD in training and generation on the micro config: a FLOP-matched pair (full depth vs MoD 20%, same
train.flop_budget), calibration of the realised skip rate, thresholds in the checkpoint, cached generation,
the --skip-rate dial, `nagmoe flops --run-dir`, exact resume, and 2 torchrun ranks agreeing on thresholds."""
import json
import os
import subprocess
import sys

import pytest
import torch

from nagmoe.cli import main
from nagmoe.config import load_config
from nagmoe.flops import flops_per_token, mod_token_ratio
from nagmoe.rundir.metrics import read_metrics
from nagmoe.train.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FULL_STEPS = 30  # the budget: 30 full-depth steps


@pytest.fixture(scope="module")
def micro_overrides(request, micro_data):
    """tests/conftest.py's MICRO_OVERRIDES plus the shared data (read from that conftest's plugin: a plain
    `from conftest import` gets whichever conftest.py was loaded last)."""
    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    data_dir, corpus = micro_data
    return [*root.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}"]


@pytest.fixture(scope="module")
def pair(micro_overrides, tmp_path_factory):
    """Both runs of the FLOP-matched pair: {"full": (trainer, summary, run_dir), "mod": (...)}."""
    root = tmp_path_factory.mktemp("mod_pair")

    def config(*overrides):
        return load_config(os.path.join(REPO, "configs/tiny.yaml"), [*micro_overrides, "train.max_steps=null",
                                                                     *overrides])

    base = config()
    budget = FULL_STEPS * flops_per_token(base.model, base.data.seq_len) * base.train.batch_tokens
    runs = {}
    for name, extra in (("full", []), ("mod", ["model.mod.skip_rate=0.2"])):
        cfg = config(f"train.flop_budget={budget}", *extra)
        run_dir = str(root / name)
        trainer = Trainer(cfg, run_dir, quiet=True)
        runs[name] = (trainer, trainer.run(), run_dir)
    return runs


def test_flop_matched_pair_reinvests_the_saved_flops_in_tokens(pair):
    (_, full, _), (trainer, mod, mod_dir) = pair["full"], pair["mod"]
    cfg = trainer.cfg
    n_full, n_mod = full["steps"], mod["steps"]
    assert full["flop_budget"] == mod["flop_budget"]
    ideal = mod_token_ratio(cfg.model, cfg.data.seq_len, mod["executed_fractions"])
    realised = mod["tokens"] / full["tokens"]
    assert ideal > 1.05  # the run did skip work
    assert abs(realised - ideal) <= ideal * (1 / n_full + 1 / n_mod + 0.01), (realised, ideal, n_full, n_mod)
    assert n_mod > n_full and abs(mod["flops"] - full["flops"]) <= 0.1 * full["flops"]
    # the trainer priced every step with its realised fractions: the flops add up to the per-step records
    records = [r for r in read_metrics(os.path.join(mod_dir, "metrics.jsonl")) if "executed_fractions" in r]
    assert len(records) == n_mod
    priced = sum(flops_per_token(cfg.model, cfg.data.seq_len, r["executed_fractions"]) for r in records)
    assert mod["flops"] == pytest.approx(priced * cfg.train.batch_tokens, rel=1e-9)
    assert full["skip_rate"] == 0.0 and full["executed_fractions"] is None


def test_realised_skip_rate_is_calibrated_to_the_target(pair):
    _, summary, run_dir = pair["mod"]
    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "skip_rate" in r]
    assert records[0]["skip_rate"] == 0.0  # the first step has no earlier scores (and is the warm-up)
    after = [r["skip_rate"] for r in records if r["step"] > 10]  # after calibration
    realised = sum(after) / len(after)
    assert abs(realised - 0.2) <= 0.02, realised
    # the summary: skip_rate over the skipping steps only, the whole run (first, full-depth step included) beside
    skipping = [r for r in records if r["mod_skipping"]]
    assert summary["skipping_steps"] == len(skipping) == len(records) - 1
    assert summary["skip_rate"] == pytest.approx(sum(r["skip_rate"] for r in skipping) / len(skipping), abs=1e-9)
    assert summary["run_skip_rate"] == pytest.approx(sum(r["skip_rate"] for r in records) / len(records), abs=1e-9)
    assert summary["run_skip_rate"] < summary["skip_rate"]
    assert sum(summary["skip_work_share_per_sublayer"]) == pytest.approx(summary["skip_rate"], abs=1e-9)
    # FLOPs as executed include attention's padded query rows: at least the FLOPs charged for the same steps
    assert summary["flops_executed"] >= summary["flops"] * (1 - 1e-12)


def _decisions(model, fn):
    """Run fn() and return, per sublayer index, the (scores, masks) its forward(s) decided with."""
    calls = {}
    real = model.stream.mod.select

    def spy(index, score_BT):
        out = real(index, score_BT)
        mask = torch.ones_like(score_BT, dtype=torch.bool) if out is None else out.mask_BT
        calls.setdefault(index, []).append((score_BT.clone(), mask.clone()))
        return out

    model.stream.mod.select = spy
    try:
        result = fn()
    finally:
        del model.stream.mod.select
    return result, {k: (torch.cat([s for s, _ in v], 1), torch.cat([m for _, m in v], 1)) for k, v in calls.items()}


def test_checkpoint_keeps_the_thresholds_and_generation_decides_like_the_full_forward(pair):
    from nagmoe.eval.generate import load_run

    trainer, _, run_dir = pair["mod"]
    run = load_run(run_dir)
    trained, loaded = trainer.model.stream.mod, run.model.stream.mod
    for name in ("threshold", "histogram", "correction", "skipping", "tokens_seen", "executed_total"):
        assert torch.equal(getattr(trained, name), getattr(loaded, name)), name
    assert bool(loaded.skipping.all())

    ids = next(iter(trainer.loader))[0][:1, :48]  # real text
    model = run.model
    with torch.no_grad():
        full, full_dec = _decisions(model, lambda: model(ids).logits)
        cache = model.new_cache(48)
        steps, step_dec = _decisions(model, lambda: torch.cat(
            [model(ids[:, t:t + 1], cache=cache).logits for t in range(48)], dim=1))
    first_close = 48
    skipped = 0
    for index, (score, mask) in full_dec.items():
        clear = (score - loaded.threshold[index]).abs() > 1e-5
        assert torch.equal(step_dec[index][1][clear], mask[clear])
        if not bool(clear.all()):
            first_close = min(first_close, int((~clear).nonzero()[:, 1].min()))
        skipped += int((~mask).sum())
    assert skipped > 0
    upto = slice(0, first_close)  # past a token at the threshold the two may legitimately differ
    err = (steps[:, upto] - full[:, upto]).abs().max()
    assert err <= 1e-4 * full[:, upto].abs().max(), err


def test_generate_skip_rate_dial(pair, capsys):
    from nagmoe.eval.generate import load_run, set_skip_rate

    trainer, _, mod_dir = pair["mod"]
    # measured on training tokens: disjoint from the validation tokens the dial calibrates on
    loader = iter(trainer.loader)
    rows = torch.cat([next(loader)[0] for _ in range(8)])
    run = load_run(mod_dir)
    mod = run.model.stream.mod
    for rate in (0.0, 0.1, 0.2, 0.4):
        dial = set_skip_rate(run, rate)
        assert dial["requested"] == rate and abs(dial["calibrated"] - rate) <= 0.01, dial
        mod.reset_inference_counts()
        with torch.no_grad():
            run.model(rows)
        realised = mod.inference_skip_rate()  # the work-weighted share, what the dial asks for
        assert abs(realised - rate) <= 0.02, (rate, realised, dial)

    assert main(["generate", "--run-dir", mod_dir, "--prompt", "ROMEO:", "--max-new-tokens", "6",
                 "--skip-rate", "0.4", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("ROMEO:") and "MoD: skipped" in out.err and "asked 40.0%; calibrated to" in out.err
    assert main(["generate", "--run-dir", mod_dir, "--prompt", "x", "--skip-rate", "1.5"]) == 2
    assert "--skip-rate" in capsys.readouterr().err
    assert main(["generate", "--run-dir", pair["full"][2], "--prompt", "x", "--skip-rate", "0.2"]) == 2
    assert "without MoD" in capsys.readouterr().err


def test_flops_command_reads_the_realised_fractions_of_a_mod_run(pair, capsys):
    trainer, summary, mod_dir = pair["mod"]
    assert main(["flops", "--config", os.path.join(mod_dir, "config.yaml"), "--run-dir", mod_dir, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = trainer.cfg
    assert out["ideal_token_ratio"] == pytest.approx(
        mod_token_ratio(cfg.model, cfg.data.seq_len, summary["executed_fractions"]))
    assert 1.0 < out["ideal_token_ratio"] < mod_token_ratio(cfg.model, cfg.data.seq_len, 0.8) + 0.01


def test_mod_resume_is_exact(micro_config, tmp_path):
    base = ["model.mod.skip_rate=0.2", "train.schedule_steps=8"]
    straight = Trainer(micro_config(*base, "train.max_steps=8"), str(tmp_path / "a"), quiet=True).run()
    Trainer(micro_config(*base, "train.max_steps=4"), str(tmp_path / "b"), quiet=True).run()
    resumed = Trainer(micro_config(*base, "train.max_steps=8"), str(tmp_path / "b"), quiet=True).run()

    def trace(d):
        return [(r["step"], r["loss"], r["executed_fractions"]) for r in read_metrics(str(d / "metrics.jsonl"))]

    assert trace(tmp_path / "a") == trace(tmp_path / "b")
    assert straight["executed_fractions"] == resumed["executed_fractions"] and straight["skip_rate"] > 0.1


@pytest.mark.distributed
def test_two_torchrun_ranks_agree_on_thresholds_and_match_one_process(micro_overrides, tmp_path):
    """DP=2 over torchrun: the histograms are all-reduced, so both ranks skip with the same thresholds and the
    run (fractions, losses) equals one process accumulating the same micro-batches."""
    overrides = [*micro_overrides, "model.mod.skip_rate=0.2", "train.max_steps=8", "train.micro_batch_tokens=64",
                 "train.device=cpu"]
    one = Trainer(load_config(os.path.join(REPO, "configs/tiny.yaml"), overrides), str(tmp_path / "one"),
                  quiet=True).run()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "nagmoe", "train", "--config",
                        os.path.join(REPO, "configs/tiny.yaml"), "--run-dir", str(tmp_path / "two"), *overrides],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "two" / "summary.json") as f:
        two = json.load(f)
    assert two["executed_fractions"] == one["executed_fractions"] and one["skip_rate"] > 0.1

    def trace(d):
        return [(r["step"], r["executed_fractions"], r["loss"]) for r in read_metrics(str(d / "metrics.jsonl"))]

    a, b = trace(tmp_path / "one"), trace(tmp_path / "two")
    assert len(a) == len(b) == 8
    for (step_a, fr_a, loss_a), (step_b, fr_b, loss_b) in zip(a, b):
        assert step_a == step_b and fr_a == fr_b and loss_a == pytest.approx(loss_b, abs=1e-5)
