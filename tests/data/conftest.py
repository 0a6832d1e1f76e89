"""Shared small corpus and one prepared data dir for the data tests (built once per session)."""
import json
import os

import pytest
import yaml

from nagmoe.config import load_config
from nagmoe.data.corpus import iter_documents, resolve_corpus

VOCAB = 512
SEQ_LEN = 64


def write_config(path, corpus, data_dir, **data):
    cfg = {"model": {"vocab_size": data.pop("vocab_size", VOCAB)},
           "data": {"corpus": str(corpus), "data_dir": str(data_dir), "seq_len": SEQ_LEN,
                    "val_fraction": 0.1, "shard_tokens": 40_000, **data}}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return str(path)


@pytest.fixture(scope="session")
def scenes():
    """140 Shakespeare scenes (about 1 MB), the raw material of the small corpus."""
    return list(iter_documents(resolve_corpus("shakespeare")))[:140]


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory, scenes):
    """Four files covering every reader: two .jsonl, one .parquet (one document per row), one .txt
    (one document per paragraph)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("corpus")
    with open(root / "a.jsonl", "w") as f:
        for s in scenes[:40]:
            f.write(json.dumps({"text": s, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": scenes[40:80]}), root / "b.parquet")
    (root / "c.txt").write_text("\n\n".join(scenes[80:100]))
    with open(root / "d.jsonl", "w") as f:
        for s in scenes[100:140]:
            f.write(json.dumps({"text": s}) + "\n")
    return root


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, small_corpus):
    """(config path, Config, data_dir) of a single-pass preparation of the small corpus."""
    from nagmoe.data.prepare import prepare_single

    root = tmp_path_factory.mktemp("prepared")
    path = write_config(root / "cfg.yaml", small_corpus, root / "data")
    cfg = load_config(path)
    prepare_single(cfg)
    return path, cfg, str(root / "data")


@pytest.fixture(scope="session")
def make_config():
    """write_config(path, corpus, data_dir, **data) -> path of a YAML config for these tests."""
    return write_config
