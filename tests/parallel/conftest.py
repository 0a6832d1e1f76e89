"""Fixtures of the distributed tests: the suite's micro config as plain override strings (they travel to the
spawned ranks, which rebuild the config from them)."""
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def micro_overrides(request, micro_data):
    """tests/conftest.py's MICRO_OVERRIDES plus the shared prepared data. Read from that conftest's plugin
    (registered under its path): `from conftest import ...` would get whichever conftest.py pytest loaded last."""
    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    data_dir, corpus = micro_data
    return [*root.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}"]


@pytest.fixture(scope="session")
def paper_vocab_data(tmp_path_factory):
    """The whole offline Shakespeare corpus at the paper's 32768-id vocabulary (a BPE trained on the corpus
    itself), 128-token rows: the data of the r40 rehearsals (test_rehearsal_r40*.py)."""
    from nagmoe.data.prepare import prepare_single
    from test_rehearsal_r40 import load, paper_overrides

    data_dir = str(tmp_path_factory.mktemp("paper_vocab") / "data")
    prepare_single(load("nag-r40", paper_overrides("nag-r40", data_dir, 2)))
    return data_dir
