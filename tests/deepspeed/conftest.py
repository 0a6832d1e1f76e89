"""Fixtures of the DeepSpeed engine tests.

DeepSpeed's CPU communication backend JIT-compiles one C++ op (deepspeed_shm_comm, ~2 min on 2 cores) the first
time a process initialises it. `ds_env` builds it once per test session into TORCH_EXTENSIONS_DIR (the one in
the environment when set, e.g. a CI cache; else a session temp dir, never the home cache) and hands every rank
process that directory, where loading the built op takes a second.
"""
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUILD_OP = ("import importlib\n"  # deepspeed.comm re-exports `torch`, which shadows its submodule of that name
            "backend = importlib.import_module('deepspeed.comm.torch')\n"
            "assert backend.build_shm_op() is not None, 'deepspeed_shm_comm did not build'\n")


@pytest.fixture(scope="session")
def ds_env(tmp_path_factory):
    """Environment for DeepSpeed processes on CPU, with its one JIT op built (timed, printed with -s)."""
    ext = os.environ.get("TORCH_EXTENSIONS_DIR") or str(tmp_path_factory.mktemp("torch_extensions"))
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": ext}
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", BUILD_OP], env={**os.environ, **env}, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"building DeepSpeed's CPU op failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    print(f"\n[deepspeed] shm op ready in {time.perf_counter() - started:.0f} s ({ext})")
    return env


@pytest.fixture(scope="session")
def micro_overrides(request, micro_data):
    """tests/conftest.py's MICRO_OVERRIDES plus the shared prepared data (read from that conftest's plugin,
    as tests/parallel does)."""
    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    data_dir, corpus = micro_data
    return [*root.MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}"]
