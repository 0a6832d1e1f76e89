"""Fixtures of the recovery tests (tests/recovery/, tests/rundir/test_config_drift.py): the micro config variants written as YAML files, and the uninterrupted
reference runs (one process; two ranks) that every interrupted run must reproduce bit for bit.

The variants (SOAK, SHORT, DIST) are defined in trainer_processes.py: test modules must not import from a
conftest.py (`from conftest import` gets whichever conftest pytest loaded last).
"""
import os
from dataclasses import dataclass

import pytest

from trainer_processes import DIST, REPO, SHORT, SOAK, records, run_trainer, start_ranks, wait_all


@dataclass
class ReferenceRun:
    config: str  # YAML path
    run_dir: str
    records: list


@pytest.fixture(scope="session")
def config_file(request, micro_data, tmp_path_factory):
    """A function writing the micro config plus overrides to CONFIGS/<name>.yaml; returns the path. MICRO_OVERRIDES
    comes from the root conftest's plugin (`from conftest import` would get whichever conftest loaded last)."""
    from nagmoe.config import dump_yaml, load_config

    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    data_dir, corpus = micro_data
    base = [*root.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}"]
    folder = tmp_path_factory.mktemp("configs")

    def write(name, *overrides):
        path = folder / f"{name}.yaml"
        path.write_text(dump_yaml(load_config(os.path.join(REPO, "configs", "tiny.yaml"), [*base, *overrides])))
        return str(path)

    return write


@pytest.fixture(scope="session")
def reference(config_file, tmp_path_factory):
    """The soak config trained in one uninterrupted process (120 steps)."""
    config = config_file("soak", *SOAK)
    run_dir = str(tmp_path_factory.mktemp("reference") / "run")
    done = run_trainer(config, run_dir)
    assert done.returncode == 0, done.stderr
    return ReferenceRun(config, run_dir, records(run_dir))


@pytest.fixture(scope="session")
def short_config(config_file):
    return config_file("short", *SHORT)


@pytest.fixture(scope="session")
def dist_reference(config_file, tmp_path_factory):
    """The DIST config (30 steps, EP=2) trained by two uninterrupted ranks."""
    config = config_file("dist", *DIST)
    tmp = tmp_path_factory.mktemp("dist_reference")
    run_dir = str(tmp / "run")
    procs = start_ranks(2, config, run_dir, str(tmp))
    codes = wait_all(procs, timeout=240)
    assert codes == [0, 0], [open(tmp / f"rank{r}.log").read()[-3000:] for r in range(2)]
    return ReferenceRun(config, run_dir, records(run_dir))
