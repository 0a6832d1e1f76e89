"""`tools/bench/bench_suite.py --device cuda`: its cca and mod sections put their work on the device asked for (on the
parent of issue 52 they ignored --device and timed the CPU). Driven on the stand-in GPU host
(tests/perf/gpu_host): asked for cuda, each bench reaches CUDA work; asked for the CPU, it runs there."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

CALLS = {
    "cca": "bench_cca.bench(os.path.join(REPO, 'configs/tiny.yaml'), 16, 1, 1, 0, device={device!r})",
    "mod": "bench_mod.bench(os.path.join(REPO, 'configs/tiny-mod20.yaml'), 1, 1, 0, device={device!r})",
}


def run_bench(repo_root, name: str, device: str) -> subprocess.CompletedProcess:
    code = (f"import os, bench_cca, bench_mod\nREPO = {repo_root!r}\n"
            f"out = {CALLS[name].format(device=device)}\nprint('ran', sorted(out)[:3])\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "gpu_host"), os.path.join(repo_root, "tools", "bench"),
                                          repo_root])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_bench_runs_where_it_is_asked(repo_root, name):
    on_cuda = run_bench(repo_root, name, "cuda")
    assert on_cuda.returncode != 0 and "CudaWorkReached" in on_cuda.stderr, on_cuda.stderr[-2000:]
    on_cpu = run_bench(repo_root, name, "cpu")
    assert on_cpu.returncode == 0 and "ran" in on_cpu.stdout, on_cpu.stderr[-2000:]
