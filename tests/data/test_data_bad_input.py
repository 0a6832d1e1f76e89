"""Bad input exits 2 with one line naming the file, and never loses an existing preparation."""
import os
import shutil
import subprocess
import sys

import pytest

from nagmoe.cli import main
from nagmoe.data.corpus import resolve_corpus
from nagmoe.data.loader import TokenLoader, iter_eval_batches
from nagmoe.data.shards import read_index
from nagmoe.data.tokenizer import file_sha256
from nagmoe.base.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args, env=None):
    """`python -m nagmoe ...` in a subprocess: (exit code, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "nagmoe", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)
    return proc.returncode, proc.stderr


def error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def snapshot(data_dir):
    return {n: file_sha256(os.path.join(data_dir, n)) for n in sorted(os.listdir(data_dir))}


@pytest.fixture
def good_copy(prepared, tmp_path):
    """A copy of the prepared data dir, for tests that corrupt or overwrite it."""
    target = tmp_path / "good"
    shutil.copytree(prepared[2], target)
    return str(target)


def test_missing_data_path_exits_2_naming_it(prepared, tmp_path):
    cfg_path = prepared[0]
    missing = tmp_path / "nowhere" / "corpus.jsonl"
    code, err = run_cli("prepare-data", "--config", cfg_path, f"data.corpus={missing}",
                        f"data.data_dir={tmp_path / 'out'}")
    assert code == 2 and "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if "error" in ln]
    assert len(lines) == 1 and str(missing) in lines[0] and "not found" in lines[0]


def test_empty_corpus_keeps_the_existing_preparation(prepared, good_copy, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    before = snapshot(good_copy)
    assert main(["prepare-data", "--config", prepared[0], f"data.corpus={empty}",
                 f"data.data_dir={good_copy}"]) == 2
    line = error_line(capsys)
    assert "empty corpus" in line and str(empty) in line
    assert snapshot(good_copy) == before  # nothing lost, no staging left behind
    next(TokenLoader(good_copy, "train", 64, 2, seed=0))


def test_vocab_mismatch_names_the_tokenizer_and_keeps_the_data(prepared, good_copy, capsys):
    tok = os.path.join(good_copy, "tokenizer.json")
    before = snapshot(good_copy)
    assert main(["prepare-data", "--config", prepared[0], f"data.data_dir={good_copy}", f"data.tokenizer={tok}",
                 "model.vocab_size=1024"]) == 2
    line = error_line(capsys)
    assert "tokenizer/model vocab mismatch" in line and tok in line
    assert snapshot(good_copy) == before


def test_vocab_the_corpus_cannot_reach_is_a_user_error(prepared, tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab ab ab\n\nba ba\n")
    assert main(["prepare-data", "--config", prepared[0], f"data.corpus={tiny}",
                 f"data.data_dir={tmp_path / 'out'}"]) == 2
    assert "too small" in error_line(capsys)


def test_wrong_checksum_in_a_shard_is_refused_by_the_loader(good_copy):
    rec = [r for r in read_index(good_copy)["shards"] if r["split"] == "train"][1]
    path = os.path.join(good_copy, rec["file"])
    with open(path, "r+b") as f:  # same size, one id changed
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(UserError, match="wrong checksum") as e:
        TokenLoader(good_copy, "train", 64, 2, seed=0)
    assert path in str(e.value)
    os.truncate(path, 10)
    with pytest.raises(UserError, match="wrong size"):
        TokenLoader(good_copy, "train", 64, 2, seed=0, verify=False)
    next(iter_eval_batches(good_copy, 64, 2))  # the val split is intact


def test_merge_refuses_a_corrupt_part_then_succeeds_after_rerunning_it(prepared, tmp_path, capsys):
    cfg_path, _, data_dir = prepared
    out = tmp_path / "sharded"
    base = ["prepare-data", "--config", cfg_path, f"data.data_dir={out}",
            f"data.tokenizer={os.path.join(data_dir, 'tokenizer.json')}"]
    assert main(base + ["--num-shards", "2", "--shard-index", "0"]) == 0
    assert main(base + ["--merge"]) == 2
    assert "missing part 1 of 2" in error_line(capsys)
    assert main(base + ["--num-shards", "2", "--shard-index", "1"]) == 0
    part = out / "parts" / "part-00001-of-00002"
    shard = sorted(part.glob("train-*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    assert main(base + ["--merge"]) == 2
    line = error_line(capsys)
    assert "wrong checksum" in line and str(shard) in line
    assert not (out / "index.json").exists() and part.exists()  # nothing committed, parts kept
    assert main(base + ["--num-shards", "2", "--shard-index", "1"]) == 0  # re-run the bad slice
    assert main(base + ["--merge"]) == 0
    for split in ("train", "val"):  # shard counts differ (each part ends in a partial shard); content not
        a, b = read_index(str(out))["totals"][split], read_index(data_dir)["totals"][split]
        assert (a["n_tokens"], a["n_documents"]) == (b["n_tokens"], b["n_documents"])


def test_slices_need_a_tokenizer_and_enough_files(prepared, tmp_path, capsys):
    base = ["prepare-data", "--config", prepared[0], f"data.data_dir={tmp_path / 'x'}"]
    assert main(base + ["--num-shards", "2", "--shard-index", "0"]) == 2
    assert "--tokenizer-only" in error_line(capsys)
    tok = f"data.tokenizer={os.path.join(prepared[2], 'tokenizer.json')}"
    assert main(base + [tok, "--num-shards", "5", "--shard-index", "0"]) == 2
    assert "exceeds the 4 input files" in error_line(capsys)
    assert main(base + [tok, "--num-shards", "2", "--shard-index", "2"]) == 2
    assert "--shard-index 2" in error_line(capsys)


def test_hub_name_while_offline_is_a_clear_error(prepared, tmp_path):
    code, err = run_cli("prepare-data", "--config", prepared[0], "data.corpus=someorg/some-dataset",
                        f"data.data_dir={tmp_path / 'hub'}", env={"HF_HUB_OFFLINE": "1"})
    assert code == 2 and "Traceback" not in err
    assert "someorg/some-dataset" in err and "offline" in err


def test_corpus_resolution_errors(tmp_path):
    with pytest.raises(UserError, match="no files match"):
        resolve_corpus(str(tmp_path / "*.jsonl"))
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(UserError, match="unsupported file type"):
        resolve_corpus(str(tmp_path / "notes.md"))
    with pytest.raises(UserError, match="no .txt/.jsonl/.json/.parquet files"):
        resolve_corpus(str(tmp_path))


def test_missing_text_field_names_the_file(prepared, small_corpus, tmp_path, capsys):
    assert main(["prepare-data", "--config", prepared[0], f"data.corpus={small_corpus / 'a.jsonl'}",
                 "data.text_field=body", f"data.data_dir={tmp_path / 'x'}"]) == 2
    line = error_line(capsys)
    assert "no field 'body'" in line and "a.jsonl" in line
