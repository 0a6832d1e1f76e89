"""The final eval's per-window losses on 2 gloo ranks (issue 66, nagmoe/train/validation.py `keep_window_losses`):
every rank's windows gathered to rank 0 into one RUN_DIR/eval_windows.json, equal to one process's.

One process trains the micro config 2 steps with 1-row micro-batches (the eval's batches are then 1 window on every
layout) and writes its file at the last step. Its run dir, copied without the file, is resumed at the stop on 2
ranks, DP=2 (parallel.ep=1) and EP=2: the summary eval there is a final eval on the very weights the one process
scored (loaded from its step-2 checkpoint), so the files must agree window by window:
  * ids, bytes and tokens exactly (they depend on the data and the sample only);
  * DP=2: nats bitwise. Each window is its own batch, scored by a full replica of the same weights through the
    same ops in the same order as in the one process (each rank runs 1 thread, as the one process here);
  * EP=2: nats within NATS_RTOL. The one thing that differs is how many rows each expert's matmuls hold (the
    rows of both ranks' windows meet at the expert's rank; rank 1, out of windows, runs a throw-away forward),
    which a GEMM may block differently: each expert output element can move by a few fp32 roundings
    (K = 32 terms: <= 32·2^-24 = 1.9e-6 relative), and a window's nats (Σ of 64 token losses of ~6 nats, each a
    logsumexp of logits moved by such relative amounts through 2 layers) by about as much relative.
A third, fresh 2-rank EP=2 run writes its file at its last step (the in-loop path): the same windows, bytes and
tokens as the one process, every rank's windows present, its bpb = its summary's val_bpb.
The one process's file read back gives summary.json's val_bpb within BPB_RTOL.
"""
import json
import math
import os
import shutil

import numpy as np
import pytest

from gloo_ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.distributed

EVAL_WINDOWS = 21  # odd: rank 0 scores 11 windows, rank 1 ten (then, under EP, a throw-away forward)
EXTRA = ("train.micro_batch_tokens=64", "train.max_steps=2", "train.schedule_steps=10",
         f"train.eval_tokens={EVAL_WINDOWS * 64}", "train.hang_timeout_s=0")
NATS_RTOL = 1e-5  # EP=2 against one process: 5x the bound in the docstring
# the summary sums each batch in float32 (bpb_sums: a cascade sum of <= 64 positive terms, within
# ceil(log2 64)·2^-24 = 3.6e-7 relative), the file each window in float64
BPB_RTOL = 1e-6


def load(overrides):
    from nagmoe.config import load_config

    return load_config(os.path.join(REPO, "configs/tiny.yaml"), overrides)


def train(overrides, run_dir):
    from nagmoe.train.trainer import Trainer

    trainer = Trainer(load(overrides), run_dir, quiet=True)
    start = trainer.progress.step
    summary = trainer.run()
    return {"start": start, "summary": summary, "ep": trainer.mesh.ep, "world_size": trainer.world_size}


def two_rank_session(overrides, tmp):
    out = {name: train([*overrides, f"parallel.ep={ep}"], os.path.join(tmp, name))
           for name, ep in (("resume_dp2", 1), ("resume_ep2", 2))}
    out["fresh_ep2"] = train([*overrides, "parallel.ep=2"], os.path.join(tmp, "fresh_ep2"))
    return out


@pytest.fixture(scope="module")
def overrides(micro_overrides):
    return [*micro_overrides, *EXTRA]


@pytest.fixture(scope="module")
def single(overrides, tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each gloo rank (gloo_ranks.py)
    try:
        run_dir = str(tmp_path_factory.mktemp("single") / "run")
        result = train(overrides, run_dir)
    finally:
        torch.set_num_threads(threads)
    return run_dir, result


@pytest.fixture(scope="module")
def session(single, overrides, tmp_path_factory):
    from nagmoe.rundir.names import EVAL_WINDOWS_FILE

    tmp = str(tmp_path_factory.mktemp("eval_windows_ranks"))
    for name in ("resume_dp2", "resume_ep2"):
        shutil.copytree(single[0], os.path.join(tmp, name))
        os.remove(os.path.join(tmp, name, EVAL_WINDOWS_FILE))  # what the 2 ranks write is theirs
    results = run_on_ranks(two_rank_session, 2, overrides, tmp, timeout=150)
    return tmp, results


def windows(run_dir):
    from nagmoe.eval.val_windows import read_window_losses

    losses = read_window_losses(run_dir)
    assert losses is not None, f"{run_dir}: no eval_windows.json"
    return losses


def assert_same_windows(got, want):
    assert got.window_ids.tolist() == want.window_ids.tolist() and len(want.window_ids) == EVAL_WINDOWS
    assert got.bytes.tolist() == want.bytes.tolist() and got.tokens.tolist() == want.tokens.tolist()
    assert (got.step, got.sample, got.seq_len, got.split_windows, got.data_fingerprint) == \
        (want.step, want.sample, want.seq_len, want.split_windows, want.data_fingerprint)
    assert got.fingerprint == want.fingerprint


def test_one_process_file_gives_the_summary_val_bpb(single):
    run_dir, result = single
    want = windows(run_dir)
    assert want.step == 2 and want.sample == "strided" and result["world_size"] == 1
    assert want.window_ids.tolist() != list(range(EVAL_WINDOWS))  # strided, not the first windows
    # a window holds a target that counts no bytes (a document's BOS): so the check below also sees that the file
    # leaves such targets out as the summary's total does (each moves bpb by ~1e-3)
    assert (want.tokens < 64).any()
    with open(os.path.join(run_dir, "summary.json")) as f:
        val_bpb = json.load(f)["val_bpb"]
    assert math.isclose(want.bpb, val_bpb, rel_tol=BPB_RTOL), (want.bpb, val_bpb)


def test_dp2_final_eval_equals_one_process_bitwise(session, single):
    tmp, results = session
    for rank in (0, 1):
        assert results[rank]["resume_dp2"]["start"] == 2 and results[rank]["resume_dp2"]["world_size"] == 2
    got, want = windows(os.path.join(tmp, "resume_dp2")), windows(single[0])
    assert_same_windows(got, want)
    assert got.nats.tobytes() == want.nats.tobytes(), (got.nats - want.nats).tolist()
    assert math.isclose(results[0]["resume_dp2"]["summary"]["val_bpb"], single[1]["summary"]["val_bpb"],
                        rel_tol=BPB_RTOL)


def test_ep2_final_eval_equals_one_process(session, single):
    tmp, results = session
    assert [r["resume_ep2"]["ep"] for r in results] == [2, 2] and results[0]["resume_ep2"]["start"] == 2
    got, want = windows(os.path.join(tmp, "resume_ep2")), windows(single[0])
    assert_same_windows(got, want)
    np.testing.assert_allclose(got.nats, want.nats, rtol=NATS_RTOL, atol=0)
    assert math.isclose(results[0]["resume_ep2"]["summary"]["val_bpb"], single[1]["summary"]["val_bpb"],
                        rel_tol=BPB_RTOL)


def test_a_fresh_two_rank_run_keeps_every_ranks_windows_at_its_last_step(session, single):
    tmp, results = session
    got, want = windows(os.path.join(tmp, "fresh_ep2")), windows(single[0])
    assert results[0]["fresh_ep2"]["start"] == 0 and results[0]["fresh_ep2"]["summary"]["steps"] == 2
    assert_same_windows(got, want)  # step 2, all 21 windows: rank 0's 11 and rank 1's 10
    assert math.isclose(got.bpb, results[0]["fresh_ep2"]["summary"]["val_bpb"], rel_tol=BPB_RTOL)
