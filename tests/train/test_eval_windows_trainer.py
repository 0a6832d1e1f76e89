"""The trainer's evaluations under issue 66 (nagmoe/train/trainer.py `evaluate(final)`):
  * the in-loop evals (train.eval_every) score the sample of train.eval_tokens_during and write no file; their
    val_bpb is that sample's, not the final sample's;
  * the final eval (the last step) scores train.eval_tokens and writes RUN_DIR/eval_windows.json: step = the last
    step, the strided sample's ids, the model's per-window losses on them (recomputed here with score_windows),
    val_bpb in metrics and summary.json = the file's bpb;
  * a run dir whose saved config.yaml predates train.eval_sample and train.eval_tokens_during resumes with the
    first-windows sample (its in-loop evals on train.eval_tokens, as before), a new run uses the strided one;
  * resumed at the stop, the summary eval is a final eval too: it writes the file.
"""
import json
import math
import os

import torch
import yaml

from nagmoe.data.eval_sample import eval_window_ids
from nagmoe.eval.val_windows import read_window_losses, score_windows
from nagmoe.rundir.metrics import read_metrics
from nagmoe.rundir.names import CONFIG_FILE, EVAL_WINDOWS_FILE, SUMMARY_FILE
from nagmoe.train.trainer import Trainer

T = 64
EVAL_WINDOWS, DURING = 22, 192  # the final sample: 22 windows (one holds a BOS target, see below); in-loop: 3
EVAL_TOKENS = EVAL_WINDOWS * T
# hang watchdog off: its stop() waits out the thread's poll (up to 5 s a run) on this machine
BASE = ("train.max_steps=2", "train.eval_every=1", f"train.eval_tokens={EVAL_TOKENS}", "train.micro_batch_tokens=128",
        "train.hang_timeout_s=0")
# the in-loop val_bpb sums each batch in float32 (bpb_sums), the file per window in float64: a cascade sum of
# <= 128 positive terms is within ceil(log2 128)·2^-24 = 4.2e-7 relative of the exact one
BPB_RTOL = 1e-6


class Recording(Trainer):
    """Records every evaluation: the step, final or not, the value, whether the file existed before and after,
    and the model's per-window losses at that moment on the during-sample and on the final sample."""

    def evaluate(self, final: bool = False) -> float:
        path = os.path.join(self.run_dir, EVAL_WINDOWS_FILE)
        before = os.path.exists(path)
        value = super().evaluate(final)
        t = self.cfg.train
        W = int(self.val_shards.window_starts(T)[-1])
        refs = {}
        for name, tokens in (("during", t.eval_tokens_during or t.eval_tokens), ("final", t.eval_tokens)):
            ids = eval_window_ids(W, tokens, T, t.eval_sample)
            with self.precision.scope():  # as the trainer's eval: same model, batches of micro_rows sample windows
                refs[name] = score_windows(self.model, self.val_shards, T, ids, self.micro_rows, self.token_bytes,
                                           self.device, self.autocast)
        self.evals.append({"step": self.progress.step, "final": final, "value": value, "before": before,
                           "after": os.path.exists(path), "refs": refs, "W": W})
        return value


def run(cfg, run_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = Recording(cfg, str(run_dir), quiet=True)
        trainer.evals = []
        summary = trainer.run()
    finally:
        torch.set_num_threads(threads)
    return trainer.evals, summary


def val_bpbs(run_dir):
    return {r["step"]: r["val_bpb"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "val_bpb" in r}


def assert_final_file(run_dir, final_eval, summary, sample, step):
    """The file of the final eval: its step, sample and ids, the model's per-window losses, val_bpb = its bpb."""
    got = read_window_losses(str(run_dir))
    want = final_eval["refs"]["final"]
    assert got.step == step and got.sample == sample and got.split == "val"
    assert got.split_windows == final_eval["W"] and got.seq_len == T
    assert got.window_ids.tolist() == eval_window_ids(final_eval["W"], EVAL_TOKENS, T, sample).tolist()
    assert got.window_ids.tolist() == want.window_ids.tolist()
    # bitwise: the trainer's eval and score_windows run the same model on the same batches through the same ops
    assert got.nats.tobytes() == want.nats.tobytes()
    assert got.bytes.tolist() == want.bytes.tolist() and got.tokens.tolist() == want.tokens.tolist()
    assert got.data_fingerprint == want.data_fingerprint
    assert math.isclose(summary["val_bpb"], got.bpb, rel_tol=BPB_RTOL) and final_eval["value"] == summary["val_bpb"]
    with open(os.path.join(run_dir, SUMMARY_FILE)) as f:
        assert json.load(f)["val_bpb"] == summary["val_bpb"]
    return got


def test_in_loop_evals_use_eval_tokens_during_and_the_last_step_keeps_the_final_windows(micro_config, tmp_path):
    run_dir = tmp_path / "run"
    evals, summary = run(micro_config(*BASE, f"train.eval_tokens_during={DURING}"), run_dir)
    assert [(e["step"], e["final"]) for e in evals] == [(1, False), (2, True)]
    during, final = evals
    # the in-loop eval: the during-sample (3 strided windows), not the final one, and no file
    assert not during["before"] and not during["after"]
    assert during["refs"]["during"].window_ids.tolist() == eval_window_ids(during["W"], DURING, T).tolist()
    assert math.isclose(during["value"], during["refs"]["during"].bpb, rel_tol=BPB_RTOL)
    assert not math.isclose(during["value"], during["refs"]["final"].bpb, rel_tol=1e-3)  # the check can fail
    assert val_bpbs(run_dir) == {1: during["value"], 2: final["value"]}
    # the final eval (last step): the strided sample of eval_tokens, written at step 2
    assert not final["before"] and final["after"]
    got = assert_final_file(run_dir, final, summary, "strided", 2)
    assert got.window_ids.tolist() != list(range(len(got.window_ids)))  # strided is not the first windows
    assert math.isclose(final["value"], final["refs"]["final"].bpb, rel_tol=BPB_RTOL)
    # a window with a target that counts no bytes (a document's BOS): val_bpb = the file's bpb checks that the file
    # leaves it out as the total does (it would move bpb by ~1e-3)
    assert (got.tokens < T).any()

    # resumed at the stop: the summary eval is a final eval and rewrites the file (same model, same numbers)
    os.remove(run_dir / EVAL_WINDOWS_FILE)
    evals, again = run(micro_config(*BASE, f"train.eval_tokens_during={DURING}"), run_dir)
    assert [(e["step"], e["final"]) for e in evals] == [(2, True)]
    resumed = read_window_losses(str(run_dir))
    assert resumed.step == 2 and resumed.nats.tobytes() == got.nats.tobytes()
    assert again["val_bpb"] == summary["val_bpb"]


def strip_issue_66_keys(run_dir):
    """What the config.yaml of a run started before issue 66 looks like."""
    path = os.path.join(run_dir, CONFIG_FILE)
    with open(path) as f:
        data = yaml.safe_load(f)
    del data["train"]["eval_sample"], data["train"]["eval_tokens_during"]
    with open(path, "w") as f:
        yaml.safe_dump(data, f)


def test_a_run_dir_from_before_issue_66_resumes_with_the_first_windows_sample(micro_config, tmp_path):
    old = tmp_path / "old"
    run(micro_config(*BASE, "train.eval_sample=first"), old)
    strip_issue_66_keys(old)
    os.remove(old / EVAL_WINDOWS_FILE)  # a run before issue 66 wrote none
    # today's defaults on the command line (eval_sample strided) and an eval_tokens_during that would differ: the
    # legacy values win (first windows; eval_tokens_during None, i.e. the in-loop evals on eval_tokens as before)
    evals, summary = run(micro_config(*BASE, "train.max_steps=4", "train.eval_every=3",
                                      f"train.eval_tokens_during={DURING}"), old)
    assert [(e["step"], e["final"]) for e in evals] == [(3, False), (4, True)]
    first = list(range(EVAL_WINDOWS))
    assert evals[0]["refs"]["during"].window_ids.tolist() == first and not evals[0]["after"]
    assert math.isclose(evals[0]["value"], evals[0]["refs"]["during"].bpb, rel_tol=BPB_RTOL)
    got = assert_final_file(old, evals[1], summary, "first", 4)
    assert got.window_ids.tolist() == first
    with open(old / CONFIG_FILE) as f:
        saved = yaml.safe_load(f)["train"]
    assert saved["eval_sample"] == "first" and saved["eval_tokens_during"] is None

    # a new run: strided
    new = tmp_path / "new"
    evals, summary = run(micro_config(*BASE), new)
    got = assert_final_file(new, evals[-1], summary, "strided", 2)
    W = evals[-1]["W"]
    n = EVAL_WINDOWS
    assert got.window_ids.tolist() == [(2 * k + 1) * W // (2 * n) for k in range(n)] != first
