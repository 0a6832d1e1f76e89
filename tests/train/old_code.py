"""A micro run trained by an older commit's code (taken from this repository's history with `git archive`, run in
its own processes), for the tests that hold today's code to what old code left on disk (test_old_checkpoint.py,
test_parent_of_the_structure_step.py)."""
import io
import os
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_with_old_code(rev: str, request, tmp_path_factory, env: dict = None) -> dict:
    """{root, code, env, run_dir, args}: 2 steps of the micro config with a checkpoint at step 2, by `rev`'s code;
    `args` are the train arguments (its own configs/tiny.yaml among them), `env` runs more of its commands."""
    if subprocess.run(["git", "-C", REPO, "cat-file", "-e", f"{rev}^{{commit}}"], capture_output=True).returncode:
        pytest.skip(f"{rev} is not in this clone's history")  # a shallow clone; CI's full clone has it
    root = tmp_path_factory.mktemp(f"code_{rev}")
    code = root / "code"
    archive = subprocess.run(["git", "-C", REPO, "archive", rev, "nagmoe", "configs"], capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(code, filter="data")
    data_dir, corpus = request.getfixturevalue("micro_data")
    micro = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py")).MICRO_OVERRIDES
    args = ["--config", str(code / "configs" / "tiny.yaml"), *micro, f"data.corpus={corpus}",
            f"data.data_dir={data_dir}", "train.checkpoint_every=2", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", **(env or {})}
    # THE CHECK THAT THE FIXTURES ARE THE OLD CODE'S: the processes below import the archived package, not this
    # checkout's (a PYTHONPATH that lost to an installed nagmoe would make a test compare today with today)
    where = subprocess.run([sys.executable, "-c", "import nagmoe; print(nagmoe.__file__)"], cwd=code, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(code)), where
    run_dir = root / "run"
    done = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--run-dir", str(run_dir), *args,
                           "train.max_steps=2"], cwd=code, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"root": root, "code": code, "env": env, "run_dir": str(run_dir), "args": args}


def with_todays_config(args: list) -> list:
    """The same train arguments with today's configs/tiny.yaml (the old one lies in the old code's archive)."""
    tiny = os.path.join("configs", "tiny.yaml")
    return [os.path.join(REPO, tiny) if a.endswith(tiny) else a for a in args]
