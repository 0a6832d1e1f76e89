import os

import pytest
import torch

from nagmoe.base.environment import inductor_cache_per_cpu_isa

# A run capped at another CPU capability (issue 50: ATEN_CPU_CAPABILITY=avx2/default) must not load kernels the
# inductor cache holds from uncapped runs: they gave NaN (docs/decisions.md). Before anything compiles.
inductor_cache_per_cpu_isa()

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fixtures shared by several test folders (tests/support/, on the test path through pytest.ini): each is built once
# per pytest process that uses it, never by one that does not
pytest_plugins = ["run_variants", "trained_run", "taken_over_run"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (tools/gpu_check/gpu_check.sh runs these)")
    for item in items:
        if item.get_closest_marker("gpu"):  # the mark, not the keyword: tests/gpu/'s CPU stand-in tests run here
            item.add_marker(skip_gpu)


@pytest.fixture
def repo_root():
    return REPO


# ----------------------------------------------------------------------------------------------------------
# Shared training fixtures: one small prepared data dir and a micro config, built once per session.
# ----------------------------------------------------------------------------------------------------------
MICRO_OVERRIDES = [
    "model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.max_seq_len=64",
    "model.attention.n_heads=2", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=32",
    "model.nag.C=4", "model.nag.warmup_tokens=256", "data.seq_len=64", "train.batch_tokens=256",
    "train.warmup_steps=4", "train.eval_tokens=1024", "train.eval_every=0", "train.checkpoint_every=0",
    "train.schedule_steps=20", "train.max_steps=20", "log.wandb=off",
]


@pytest.fixture(scope="session")
def micro_data(tmp_path_factory):
    """A prepared data dir (vocab 512) from 60 Shakespeare scenes."""
    import json

    from nagmoe.config import load_config
    from nagmoe.data.corpus import iter_documents, resolve_corpus
    from nagmoe.data.prepare import prepare_single

    root = tmp_path_factory.mktemp("micro_data")
    docs = list(iter_documents(resolve_corpus("shakespeare")))[:60]
    with open(root / "corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"),
                      [*MICRO_OVERRIDES, f"data.corpus={root / 'corpus.jsonl'}", f"data.data_dir={root / 'data'}",
                       "data.val_fraction=0.1"])
    prepare_single(cfg)
    return str(root / "data"), str(root / "corpus.jsonl")


@pytest.fixture
def micro_config(micro_data):
    """A function building the micro config (tiny NAG MoE) on the shared data, with extra overrides."""
    from nagmoe.config import load_config

    data_dir, corpus = micro_data

    def make(*overrides):
        return load_config(os.path.join(REPO, "configs/tiny.yaml"),
                           [*MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}", *overrides])

    return make


@pytest.fixture
def nagmoe_cli(capsys):
    """`nagmoe ARGV` in this process (the CLI entry); returns its stdout, failing the test on a non-zero exit."""
    from nagmoe.cli import main

    def run(*argv) -> str:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        out = capsys.readouterr()
        assert code == 0, out.err[-2000:]
        return out.out

    return run
