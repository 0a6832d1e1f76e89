"""`nagmoe prepare-data --dry-run`: the plan from the config alone (shards, bytes, split, Slurm array, time),
checked against a hand computation for the paper config; it reads and writes no data, and bad input exits 2
with one line naming the flag."""
import json
import math
import os

import pytest

from nagmoe.cli import main
from nagmoe.commands import prepare_data as cmd

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER = os.path.join(REPO, "configs/paper/nag-r40.yaml")  # vocab 32768, shard_tokens 2**24, val_fraction 0.001
PAPER_MOD = os.path.join(REPO, "configs/paper/nag-mod20-r40.yaml")
TINY = os.path.join(REPO, "configs/tiny.yaml")

# By hand, for 61e9 training tokens with the paper config:
#   corpus = ceil(61e9 / (1 - 0.001)) = ceil(61,061,061,061.06) = 61,061,061,062 tokens; val = 61,061,062
#   train shards = ceil(61e9 / 16,777,216) = ceil(3,635.87) = 3,636; val shards = ceil(3.64) = 4
#   uint16 (32768 <= 65536): 2 bytes per token -> 122,122,122,124 bytes (train 122,000,000,000)
HAND = {"total": 61_061_061_062, "val": 61_061_062, "train_shards": 3636, "val_shards": 4,
        "bytes": 122_122_122_124, "train_bytes": 122_000_000_000}


def cli(*argv):
    """main(argv)'s exit code; argparse's own errors exit through SystemExit."""
    try:
        return main(list(argv))
    except SystemExit as e:
        return e.code


def dry_run(capsys, *argv):
    code = cli("prepare-data", *argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_paper_plan_matches_the_hand_computation(tmp_path, capsys):
    data_dir = tmp_path / "data"
    out = dry_run(capsys, "--config", PAPER, f"data.data_dir={data_dir}", "--dry-run", "--tokens", "61e9")
    assert "61,000,000,000 training tokens" in out
    assert f"{HAND['total']:,} tokens to tokenise: train 61,000,000,000 + val {HAND['val']:,}" in out
    assert "uint16, 2 bytes per token" in out
    assert f"train {HAND['train_shards']:,} + val {HAND['val_shards']} of data.shard_tokens 16,777,216" in out
    assert f"{HAND['bytes']:,} bytes" in out and f"train {HAND['train_bytes']:,}" in out
    assert "sbatch --array=0-" in out and "measured on 2026-12-01 on a 2-core CPU machine" in out

    plan = json.loads(dry_run(capsys, "--config", PAPER, f"data.data_dir={data_dir}", "--dry-run",
                              "--tokens", "61e9", "--json", "--num-shards", "64"))
    assert plan["total_tokens"] == HAND["total"] and plan["val_tokens"] == HAND["val"]
    assert plan["shards"] == {"train": HAND["train_shards"], "val": HAND["val_shards"]}
    assert plan["shards_max"] == {"train": HAND["train_shards"] + 63, "val": HAND["val_shards"] + 63}
    assert plan["bytes"] == {"train": HAND["train_bytes"], "val": 2 * HAND["val"], "total": HAND["bytes"]}
    assert plan["dtype"] == "uint16" and plan["num_shards"] == 64 and not plan["num_shards_suggested"]
    # time: data.num_proc=16 workers outrun one reading main process, which then bounds the task
    assert plan["task_tokens_per_s"] == cmd.READER_TOKENS_PER_S
    assert plan["task_seconds"] == pytest.approx(HAND["total"] / 64 / cmd.READER_TOKENS_PER_S)
    assert not data_dir.exists() and os.listdir(tmp_path) == []


def test_suggested_array_keeps_tasks_near_the_target_time(capsys, tmp_path):
    plan = json.loads(dry_run(capsys, "--config", PAPER, f"data.data_dir={tmp_path / 'd'}", "--dry-run",
                              "--tokens", "61e9", "--json"))
    n = plan["num_shards"]
    assert plan["num_shards_suggested"] and n == math.ceil(HAND["total"] / cmd.READER_TOKENS_PER_S / cmd.TASK_TARGET_S)
    assert plan["task_seconds"] <= cmd.TASK_TARGET_S
    one = json.loads(dry_run(capsys, "--config", PAPER, f"data.data_dir={tmp_path / 'd'}", "data.num_proc=1",
                             "--dry-run", "--tokens", "61e9", "--json", "--num-shards", "1"))
    # one process reads and tokenises in series
    rate = 1 / (1 / cmd.READER_TOKENS_PER_S + 1 / cmd.WORKER_TOKENS_PER_S)
    assert one["task_seconds"] == pytest.approx(HAND["total"] / rate) and one["cpus_per_task"] == 1


def test_dtype_follows_the_shard_writer_rule(capsys, tmp_path):
    plan = json.loads(dry_run(capsys, "--config", PAPER, f"data.data_dir={tmp_path / 'd'}", "model.vocab_size=65537",
                              "--dry-run", "--tokens", "1000", "--json"))
    assert plan["dtype"] == "uint32" and plan["bytes"]["total"] == 4 * plan["total_tokens"]


def test_default_target_is_the_runs_need(capsys, tmp_path):
    from nagmoe.config import budget_tokens, load_config

    d = f"data.data_dir={tmp_path / 'd'}"
    tiny = json.loads(dry_run(capsys, "--config", TINY, d, "--dry-run", "--json"))
    assert tiny["target_tokens"] == 400 * 8192  # train.max_steps x train.batch_tokens
    mod = json.loads(dry_run(capsys, "--config", PAPER_MOD, d, "--dry-run", "--json"))
    full = budget_tokens(load_config(PAPER_MOD))  # ~50e9 tokens at full depth
    assert mod["target_tokens"] == math.ceil(full / (1 - 0.2)) > 60.9e9  # the paper's MoD run: 60.9B tokens


def test_needs_no_corpus_and_writes_nothing(tmp_path, capsys):
    """A corpus that does not exist and a data dir that does not exist: the plan still prints, and nothing
    appears anywhere under tmp_path (nor in the working directory)."""
    data_dir = tmp_path / "data"
    before = sorted(os.listdir(REPO))
    out = dry_run(capsys, "--config", PAPER, f"data.data_dir={data_dir}",
                  f"data.corpus={tmp_path / 'missing' / 'climbmix-*.parquet'}", "--dry-run", "--tokens", "1e9")
    assert "nothing read or written" in out
    assert os.listdir(tmp_path) == [] and sorted(os.listdir(REPO)) == before


@pytest.mark.parametrize("argv, flag", [
    (["--dry-run", "--tokens", "0"], "--tokens"),
    (["--dry-run", "--tokens", "-5e9"], "--tokens"),
    (["--dry-run", "--tokens", "nan"], "--tokens"),
    (["--dry-run", "--tokens", "lots"], "--tokens"),
    (["--dry-run", "--tokens", "1e9", "--num-shards", "0"], "--num-shards"),
    (["--dry-run", "--num-shards", "4", "--shard-index", "1"], "--shard-index"),
    (["--dry-run", "--merge"], "--merge"),
    (["--tokens", "1e9"], "--tokens"),  # a real preparation: --tokens only sizes a dry run
    (["--json"], "--json"),
])
def test_bad_input_exits_2_with_one_line_naming_the_flag(argv, flag, tmp_path, capsys):
    data_dir = tmp_path / "data"
    assert cli("prepare-data", "--config", PAPER, f"data.data_dir={data_dir}", *argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in err, err
    assert out == "" and not data_dir.exists()
