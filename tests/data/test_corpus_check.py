"""Issue 67: a `data.corpus` this machine cannot prepare stops `nagmoe config` and `nagmoe train` with one line
naming docs/paper-corpus.md's command, but only where `data.data_dir` is not prepared (nagmoe/data/corpus.py,
`check_data_preparable`). No test here reaches the network: a bare name is refused without a request, and the
hub's one metadata request (`hub_has_dataset`) is replaced where an `org/name` id gets that far."""
import os

import pytest

from nagmoe.cli import main
from nagmoe.data import corpus as corpus_mod

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAPER = os.path.join(REPO, "configs", "paper", "nag-mod20-r40.yaml")


@pytest.fixture
def no_network(monkeypatch):
    def refuse(name, timeout=None):
        raise AssertionError(f"the check asked the hub about {name!r}")

    monkeypatch.setattr(corpus_mod, "hub_has_dataset", refuse)


def error_line(capsys, command: str, out: str = "") -> str:
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.startswith(f"nagmoe {command}: error:")]
    assert len(lines) == 1 and len(lines[0]) < 1000 and out in captured.out, captured.err
    return lines[0]


def test_config_and_train_stop_on_the_paper_corpus_where_its_data_is_not_prepared(tmp_path, capsys, no_network):
    data_dir = f"data.data_dir={tmp_path / 'not-prepared'}"
    assert main(["config", "--config", PAPER, data_dir]) == 2
    line = error_line(capsys, "config", out="  corpus: climbmix\n")  # the config is printed before the line
    for part in ("data.corpus='climbmix' cannot be prepared here", "not a hub dataset id (org/name)",
                 "docs/paper-corpus.md", f"nagmoe prepare-data --config '{PAPER}' data.corpus=FILES"):
        assert part in line, line
    run_dir = tmp_path / "run"
    assert main(["train", "--config", PAPER, data_dir, "--run-dir", str(run_dir)]) == 2
    assert error_line(capsys, "train").split(": error: ")[1] == line.split(": error: ")[1]
    assert not run_dir.exists()  # stopped before the run dir or a process group
    # a local path that is not there is named as such; one that is there can be prepared: no line
    assert main(["config", "--config", PAPER, data_dir, f"data.corpus={tmp_path / 'nowhere' / 'a.parquet'}"]) == 2
    assert "data path not found" in error_line(capsys, "config")
    (tmp_path / "docs.jsonl").write_text('{"text": "a document"}\n')
    assert main(["config", "--config", PAPER, data_dir, f"data.corpus={tmp_path / 'docs.jsonl'}"]) == 0


def test_a_hub_id_is_asked_only_where_the_hub_may_answer(tmp_path, capsys, monkeypatch, no_network):
    pytest.importorskip("datasets")
    args = ["config", "--config", PAPER, f"data.data_dir={tmp_path / 'not-prepared'}", "data.corpus=org/name"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # declared offline: refused without a request
    assert main(args) == 2
    assert "the Hugging Face hub is offline" in error_line(capsys, "config")
    for var in corpus_mod.HUB_OFFLINE_VARS:
        monkeypatch.delenv(var, raising=False)
    asked = []
    answers = {"org/name": "the Hugging Face hub did not answer (ConnectError)"}
    monkeypatch.setattr(corpus_mod, "hub_has_dataset", lambda name, timeout=None: asked.append(name) or answers[name])
    assert main(args) == 2
    assert "the Hugging Face hub did not answer (ConnectError)" in error_line(capsys, "config")
    answers["org/name"] = None  # the hub has it: prepare-data can stream it here
    assert main(args) == 0 and asked == ["org/name", "org/name"]


def test_prepared_data_trains_whatever_the_corpus_says(micro_config, tmp_path, capsys, no_network):
    from nagmoe.config import dump_yaml

    config = tmp_path / "climbmix.yaml"
    config.write_text(dump_yaml(micro_config("data.corpus=climbmix", "train.max_steps=2")))
    assert main(["config", "--config", str(config)]) == 0
    assert main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--quiet"]) == 0
    assert (tmp_path / "run" / "summary.json").is_file()
