"""Bad input never crashes (issue 16, item 3): a missing or corrupt shard, token ids >= vocab, a tokenizer
that does not match the run, malformed YAML -> exit 2 with one line naming the problem, no traceback, and
the run dir already written is left byte for byte as it was. Fuzzed configs: test_config_fuzz.py."""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from cli_process import nagmoe_cli


def tree_digest(folder: str) -> dict:
    """sha256 of every file under `folder` (relative path -> digest)."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def assert_one_line_exit_2(done, *fragments):
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, done.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture
def copy_of_run(trained_run, tmp_path):
    folder = str(tmp_path / "copy")
    shutil.copytree(trained_run, folder)
    with open(os.path.join(folder, "data", "index.json")) as f:
        index = json.load(f)
    train_shard = next(r for r in index["shards"] if r["split"] == "train")
    return folder, index, train_shard


def resume(folder):
    return nagmoe_cli("train", "--config", "config.yaml", "--run-dir", "run", "--quiet", cwd=folder)


def test_missing_shard(copy_of_run):
    folder, _, shard = copy_of_run
    before = tree_digest(os.path.join(folder, "run"))
    os.remove(os.path.join(folder, "data", shard["file"]))
    assert_one_line_exit_2(resume(folder), shard["file"])
    assert tree_digest(os.path.join(folder, "run")) == before


def test_corrupt_shard(copy_of_run):
    folder, _, shard = copy_of_run
    before = tree_digest(os.path.join(folder, "run"))
    with open(os.path.join(folder, "data", shard["file"]), "r+b") as f:
        f.seek(1000)
        f.write(b"\xff\xff\xff\xff")  # same size, different bytes
    assert_one_line_exit_2(resume(folder), shard["file"])
    assert tree_digest(os.path.join(folder, "run")) == before


def test_token_ids_beyond_vocab(copy_of_run):
    """A shard written with a bigger tokenizer (its checksum recorded consistently): every id >= vocab."""
    folder, index, shard = copy_of_run
    path = os.path.join(folder, "data", shard["file"])
    ids = np.memmap(path, dtype=shard["dtype"], mode="r+")
    ids[:] = index["vocab_size"] + 5
    ids.flush()
    del ids
    with open(path, "rb") as f:
        shard["sha256"] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(folder, "data", "index.json"), "w") as f:
        json.dump(index, f)
    done = nagmoe_cli("train", "--config", "config.yaml", "--run-dir", "fresh", "--quiet", cwd=folder)
    assert_one_line_exit_2(done, shard["file"], f"token id {index['vocab_size'] + 5} >= vocab_size")
    assert not os.path.isdir(os.path.join(folder, "fresh", "checkpoints"))


def test_tokenizer_not_the_one_of_the_run(copy_of_run):
    """Same vocabulary size, different tokenizer (two ids swapped): generate refuses instead of decoding
    garbage."""
    folder, _, _ = copy_of_run
    tok_path = os.path.join(folder, "data", "tokenizer.json")
    with open(tok_path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(tok_path, "w") as f:
        json.dump(tok, f)
    before = tree_digest(os.path.join(folder, "run"))
    done = nagmoe_cli("generate", "--run-dir", "run", "--prompt", "To be", "--max-new-tokens", "2", cwd=folder)
    assert_one_line_exit_2(done, "tokenizer.json", "not the tokenizer")
    assert tree_digest(os.path.join(folder, "run")) == before


def test_malformed_yaml(copy_of_run):
    folder, _, _ = copy_of_run
    before = tree_digest(os.path.join(folder, "run"))
    with open(os.path.join(folder, "config.yaml"), "a") as f:
        f.write("train: [unclosed\n  - : :\n")
    assert_one_line_exit_2(resume(folder), "config.yaml", "invalid YAML")
    assert tree_digest(os.path.join(folder, "run")) == before
