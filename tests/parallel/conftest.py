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
