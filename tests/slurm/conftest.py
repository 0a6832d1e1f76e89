"""Fixtures of the Slurm launch tests: `slurm_cluster`, a real single-node Slurm for the whole session
(slurm_cluster.py), and `micro_yaml`, the shared micro config written to a YAML file.

The cluster tests skip only when the Slurm binaries are missing *and* the CI variable is unset: in CI a
missing Slurm is a failure.
"""

import pytest

from slurm_cluster import SLURM_MICRO, running_cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def micro_yaml(micro_config, tmp_path):
    """A function writing the micro config (+ overrides) to a YAML file; returns its path."""
    from nagmoe.config import dump_yaml

    def write(*overrides, name="micro.yaml"):
        path = tmp_path / name
        path.write_text(dump_yaml(micro_config(*SLURM_MICRO, *overrides)))
        return str(path)

    return write
