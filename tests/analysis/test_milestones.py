"""Issue 27: `nagmoe analyze --milestones` reads a run's milestones (kept through pruning by
`train.keep_milestone_every_tokens`) and the latest checkpoint, and reports norm, rotation, skip and router health
through training, measured on the same validation windows; `nagmoe report` shows them in its depth section.
Issue 68, item 4: the milestones are weights-only (bf16, under milestones/); full ones still read
(tests/checkpoint/test_milestone.py)."""
import json
import os

from nagmoe.cli import main
from nagmoe.train.trainer import Trainer


def test_analyze_reports_the_milestones_through_training(micro_config, tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    # 256 tokens per step: milestones at steps 2 and 4 (MoD skipping from the start), the last at step 5
    Trainer(micro_config("train.max_steps=5", "train.checkpoint_every=1", "train.keep_checkpoints=1",
                         "train.keep_milestone_every_tokens=512", "model.mod.skip_rate=0.2",
                         "model.mod.start_tokens=0", "model.nag.warmup_tokens=0"), run_dir, quiet=True).run()
    out = tmp_path / "a.json"
    assert main(["analyze", "--run-dir", run_dir, "--out", str(out), "--tokens", "512", "--milestones",
                 "--device", "cpu"]) == 0
    rows = json.loads(out.read_text())["through_training"]
    assert [(r["step"], r["tokens"], r["milestone"]) for r in rows] == [(2, 512, True), (4, 1024, True),
                                                                        (5, 1280, False)]
    # the two milestones are weights-only ones, the only copies of their steps (keep_checkpoints=1 pruned the rest)
    paths = [r["checkpoint"] for r in rows[:2]]
    assert paths == [os.path.join(run_dir, "milestones", f"step_00000{s}") for s in (2, 4)]
    assert [json.load(open(os.path.join(p, "state.json")))["format"] for p in paths] == ["weights-1"] * 2
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_000005"]
    for r in rows:
        assert r["val_loss"] > 0 and r["norm_growth"] > 0 and r["cumulative_rotation"] > 0
        assert 0 < r["skip_rate"] < 1 and r["router_max_over_mean"] >= 1 and r["router_dead_experts"] >= 0
    assert len({r["val_loss"] for r in rows}) == 3  # three different checkpoints were measured
    assert "step 2 (milestone): val loss" in capsys.readouterr().out

    assert main(["report", run_dir, "--out", str(tmp_path / "report"), "--eval-items", "4",
                 "--analysis-tokens", "512", "--device", "cpu"]) == 0
    html = (tmp_path / "report" / "report.html").read_text()
    assert "Through training (milestone checkpoints)" in html
    table = html.split("Through training (milestone checkpoints)")[1].split("</table>")[0]
    assert table.count("<tr>") - 1 == 3  # a header and the three measured checkpoints
