"""prepare-data: round trip, index contents, sharded preparation == single pass."""
import json
import os

import numpy as np

from nagmoe.cli import main
from nagmoe.config import load_config
from nagmoe.data.corpus import is_val_document, iter_documents, resolve_corpus, split_scenes
from nagmoe.data.shards import read_index
from nagmoe.data.tokenizer import encode_documents, file_sha256, load_tokenizer


def split_stream(data_dir, split):
    index = read_index(data_dir)
    parts = [np.fromfile(os.path.join(data_dir, r["file"]), dtype=r["dtype"])
             for r in index["shards"] if r["split"] == split]
    return np.concatenate(parts)


def documents_of(stream, bos):
    starts = np.flatnonzero(stream == bos).tolist() + [len(stream)]
    assert starts[0] == 0, "the stream must start with BOS"
    return [stream[a + 1:b] for a, b in zip(starts[:-1], starts[1:])]


def test_split_scenes_one_document_per_section():
    play = ("# A Play\n\n## ACT I\n\n### SCENE I. Here.  \n\nA line.  \n\n### SCENE II. There.\n\nB line.\n"
            "## ACT II\n### SCENE I. Again.\nC line.\n\n# EPILOGUE\nD line.\n")
    docs = split_scenes(play)
    assert docs == ["# A Play\n\n## ACT I\n\n### SCENE I. Here.\n\nA line.\n",
                    "# A Play\n\n### SCENE II. There.\n\nB line.\n",
                    "# A Play\n\n## ACT II\n### SCENE I. Again.\nC line.\n",
                    "# A Play\n\n# EPILOGUE\nD line.\n"]


def test_text_tokens_text_round_trip(prepared, small_corpus, scenes):
    _, cfg, data_dir = prepared
    tok = load_tokenizer(os.path.join(data_dir, "tokenizer.json"))
    docs = list(iter_documents(resolve_corpus(str(small_corpus))))
    assert docs[:40] == scenes[:40]  # .jsonl: one document per row, read in file order
    assert docs[40:80] == scenes[40:80]  # .parquet
    assert len(docs) > 140  # .txt: one document per paragraph
    for split in ("train", "val"):
        expected = [d for d in docs if is_val_document(d, cfg.data.val_fraction) == (split == "val")]
        decoded = [tok.decode(ids.tolist()) for ids in documents_of(split_stream(data_dir, split), 0)]
        assert decoded == expected
        assert len(expected) > 5


def test_index_records_shards_checksums_and_totals(prepared):
    _, cfg, data_dir = prepared
    index = read_index(data_dir)
    assert index["vocab_size"] == 512 and index["dtype"] == "uint16" and index["bos_id"] == 0
    assert index["tokenizer_sha256"] == file_sha256(os.path.join(data_dir, "tokenizer.json"))
    for split in ("train", "val"):
        recs = [r for r in index["shards"] if r["split"] == split]
        assert sum(r["n_tokens"] for r in recs) == index["totals"][split]["n_tokens"]
        assert sum(r["n_documents"] for r in recs) == index["totals"][split]["n_documents"]
        assert all(r["n_tokens"] == cfg.data.shard_tokens for r in recs[:-1])
        for r in recs:
            path = os.path.join(data_dir, r["file"])
            assert os.path.getsize(path) == 2 * r["n_tokens"] and file_sha256(path) == r["sha256"]
    assert index["totals"]["train"]["n_shards"] > 1
    names = set(os.listdir(data_dir))
    assert names == {"index.json", "tokenizer.json"} | {r["file"] for r in index["shards"]}


def test_literal_bos_string_in_text_is_not_a_bos_token(prepared):
    tok = load_tokenizer(os.path.join(prepared[2], "tokenizer.json"))
    text = "Enter <|bos|> here"
    ids = encode_documents(tok, [text], bos=0, dtype=np.dtype(np.uint16))[0]
    assert ids[0] == 0 and (ids[1:] != 0).all()
    assert tok.decode(ids[1:].tolist()) == text


def test_two_slices_and_merge_equal_the_single_pass(prepared, small_corpus, tmp_path, monkeypatch, make_config):
    _, _, single_dir = prepared
    data_dir = tmp_path / "sharded"
    cfg_path = make_config(tmp_path / "cfg.yaml", small_corpus, data_dir)
    assert main(["prepare-data", "--config", cfg_path, "--tokenizer-only"]) == 0
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")  # slice 0 takes its index from the array task
    assert main(["prepare-data", "--config", cfg_path, "--num-shards", "2"]) == 0
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    # slice 1 tokenises in 2 worker processes: same ids, same order
    assert main(["prepare-data", "--config", cfg_path, "--num-shards", "2", "--shard-index", "1",
                 "data.num_proc=2"]) == 0
    parts = sorted((data_dir / "parts").glob("part-*"))
    assert [p.name for p in parts] == ["part-00000-of-00002", "part-00001-of-00002"]
    for p in parts:  # both slices hold real work
        totals = json.loads((p / "part.json").read_text())["totals"]
        assert totals["train"]["n_tokens"] > 0
    assert main(["prepare-data", "--config", cfg_path, "--merge"]) == 0
    assert not (data_dir / "parts").exists()
    assert file_sha256(data_dir / "tokenizer.json") == file_sha256(os.path.join(single_dir, "tokenizer.json"))
    for split in ("train", "val"):
        np.testing.assert_array_equal(split_stream(str(data_dir), split), split_stream(single_dir, split))
    a, b = read_index(str(data_dir)), read_index(single_dir)
    assert a["totals"]["train"]["n_tokens"] == b["totals"]["train"]["n_tokens"]
    assert a["totals"]["val"]["n_documents"] == b["totals"]["val"]["n_documents"]


def test_preparing_again_replaces_the_old_shards(prepared, tmp_path):
    cfg_path, _, data_dir = prepared
    import shutil

    target = tmp_path / "again"
    shutil.copytree(data_dir, target)
    old = set(os.listdir(target))
    cfg = load_config(cfg_path, [f"data.data_dir={target}", "data.shard_tokens=100000",
                                 f"data.tokenizer={target / 'tokenizer.json'}"])
    from nagmoe.data.prepare import prepare_single

    index = prepare_single(cfg)
    names = set(os.listdir(target))
    assert names == {"index.json", "tokenizer.json"} | {r["file"] for r in index["shards"]}
    assert names != old
    np.testing.assert_array_equal(split_stream(str(target), "train"), split_stream(data_dir, "train"))
