"""`tools/gpu_check.sh --cpu`: the GPU check's smoke mode runs here with datasets, wandb and deepspeed hidden
from every import (as on the GPU machine), and prints its summary table."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_gpu_check_cpu_smoke_mode_runs_with_optional_packages_hidden(repo_root, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", os.path.join(repo_root, "tools/gpu_check.sh"), "--cpu"], cwd=repo_root,
                          env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    out = proc.stdout
    for section in ("env", "tests", "bench"):
        assert f"== {section}: ok" in out
    assert "| nag_eager |" in out and "MoE loop / grouped" in out
    assert "skipped" in (tmp_path / "tests.log").read_text()  # the gpu tests were collected, then skipped
    result = json.loads((tmp_path / "bench.json").read_text())
    assert {"baseline", "nag_eager", "mod"} <= set(result["nag"]) and result["goals"]


def test_the_blocker_really_hides_the_optional_packages(repo_root, tmp_path):
    """The blocker the script installs makes `import wandb` fail even where wandb is installed (here it is)."""
    script = open(os.path.join(repo_root, "tools/gpu_check.sh")).read()
    blocker = script.split("<<'PYEOF'\n", 1)[1].split("PYEOF\n", 1)[0]
    (tmp_path / "sitecustomize.py").write_text(blocker)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{repo_root}"}
    code = ("import importlib\nfor n in ('datasets', 'wandb', 'deepspeed'):\n"
            "    try:\n        importlib.import_module(n)\n        print('imported', n)\n"
            "    except ImportError as e:\n        print('hidden', n, e)\nimport nagmoe.train.trainer\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [["hidden", n] for n in ("datasets", "wandb", "deepspeed")]
