"""`python -m nagmoe` in a process of its own, for the tests that drive the command line from outside."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def nagmoe_cli(*args, cwd, timeout=120):
    """`python -m nagmoe ARGS` in `cwd` with one OpenMP thread; the CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "nagmoe", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=timeout)
