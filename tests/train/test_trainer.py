"""The trainer on real (tiny) data: exact resume, FLOP-budget stop, metrics, run-dir contents, bad input."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from nagmoe.base.errors import UserError
from nagmoe.flops import flops_per_token
from nagmoe.checkpoint import latest_valid_checkpoint
from nagmoe.rundir.metrics import read_metrics
from nagmoe.train.trainer import Trainer


def train(cfg, run_dir, **kw):
    return Trainer(cfg, str(run_dir), quiet=True, **kw).run()


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]


def test_resume_is_bitwise_exact_and_logs_each_step_once(micro_config, tmp_path):
    # schedule_steps fixed at 20 with warmdown over the last 65%: steps 7..20 anneal, so the resume point
    # (10) sits inside a non-trivial warm-down.
    base = ["train.schedule_steps=20", "train.warmdown_frac=0.65", "train.micro_batch_tokens=128"]
    straight = tmp_path / "straight"
    train(micro_config(*base, "train.max_steps=20"), straight)
    split = tmp_path / "split"
    train(micro_config(*base, "train.max_steps=10", "train.checkpoint_every=5"), split)
    assert latest_valid_checkpoint(str(split)).endswith("step_000010")
    # a crash after step 10 left extra metric lines and a half-written checkpoint: both must be ignored
    with open(split / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 11, "loss": 123.0}) + "\n")
    os.makedirs(split / "checkpoints" / "step_000012.tmp-999")
    summary = train(micro_config(*base, "train.max_steps=20", "train.checkpoint_every=5"), split)
    a, b = losses(straight), losses(split)
    assert [s for s, _ in b] == list(range(1, 21))  # each step once
    assert a == b  # bitwise: the floats compare equal
    lrs = [r["lr_mult"] for r in read_metrics(os.path.join(split, "metrics.jsonl")) if "lr_mult" in r]
    assert lrs[9] < 1.0 and lrs[19] < lrs[9]  # warm-down under way across the resume point
    assert summary["steps"] == 20 and summary["tokens"] == 20 * 256


def test_flop_budget_stops_within_one_step(micro_config, tmp_path):
    cfg = micro_config("train.max_steps=null")
    step_flops = flops_per_token(cfg.model, cfg.data.seq_len) * cfg.train.batch_tokens
    budget = 7.3 * step_flops
    cfg = micro_config("train.max_steps=null", f"train.flop_budget={budget}")
    summary = train(cfg, tmp_path / "run")
    assert abs(summary["flops"] - budget) <= step_flops
    assert summary["steps"] == 7


def test_run_dir_contents(micro_config, tmp_path):
    run = tmp_path / "run"
    summary = train(micro_config("train.max_steps=4", "train.eval_every=2"), run)
    for name in ("config.yaml", "metrics.jsonl", "run_info.json", "summary.json"):
        assert (run / name).is_file(), name
    info = json.loads((run / "run_info.json").read_text())
    assert info["git_commit"] and info["versions"]["torch"] and info["backends"]
    records = read_metrics(str(run / "metrics.jsonl"))
    for r in records:
        for key in ("step", "tokens", "flops", "loss", "lr", "tokens_per_s"):
            assert key in r
    assert [r["step"] for r in records if "val_bpb" in r] == [2, 4]
    assert summary["val_bpb"] == records[-1]["val_bpb"]
    for key in ("val_bpb", "tokens", "flops", "wall_time_s", "skip_rate"):
        assert key in summary


def test_resume_with_changed_model_refuses(micro_config, tmp_path):
    run = tmp_path / "run"
    train(micro_config("train.max_steps=2"), run)
    with pytest.raises(UserError, match="model.d_model"):
        Trainer(micro_config("train.max_steps=4", "model.d_model=48"), str(run), quiet=True)
    train(micro_config("train.max_steps=3", "train.lr_gate=0.002"), run, accept_config_change=True)  # accepted


def test_bad_data_inputs_exit_2_naming_the_file(micro_config, micro_data, tmp_path, repo_root):
    data_dir, _ = micro_data
    # vocab mismatch
    with pytest.raises(UserError, match="vocab mismatch.*tokenizer.json"):
        Trainer(micro_config("model.vocab_size=1024"), str(tmp_path / "r1"), quiet=True)
    # missing data dir, through the CLI: one line, exit 2
    r = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--config", "configs/tiny.yaml",
                        "--run-dir", str(tmp_path / "r2"), f"data.data_dir={tmp_path / 'nowhere'}", "--quiet"],
                       cwd=repo_root, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nowhere" in r.stderr
    # a shard with a wrong checksum
    bad = tmp_path / "bad_data"
    shutil.copytree(data_dir, bad)
    shard = next(p for p in os.listdir(bad) if p.startswith("train") and p.endswith(".bin"))
    with open(bad / shard, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(UserError, match=shard):
        Trainer(micro_config(f"data.data_dir={bad}"), str(tmp_path / "r3"), quiet=True)
    assert not os.path.exists(tmp_path / "r3" / "metrics.jsonl")


def test_muon_parameters_on_the_real_model(micro_config):
    from nagmoe.model import build_model
    from nagmoe.train.optim import build_optimizers

    cfg = micro_config()
    model = build_model(cfg.model)
    bundle = build_optimizers(model, cfg.train)
    muon = sorted(bundle.muon_param_names())
    expected = sorted(n for n, _ in model.named_parameters()
                      if n.endswith(("c_q.weight", "c_k.weight", "c_v.weight", "c_proj.weight", "w_in", "w_out")))
    assert muon == expected
    roles = bundle.param_names_by_role()
    assert all("gate" in n or "stream" in n for n in roles["gate"])
    gate_groups = [g for opt in bundle for g in opt.param_groups if g.get("role") == "gate"]
    assert gate_groups and all(g["initial_lr"] == cfg.train.lr_gate for g in gate_groups)
    assert all(g["weight_decay"] == 0.0 for g in gate_groups)
    assert not any("router" in n for n in muon)
