"""The CLI: bad input gives one line on stderr and exit code 2, never a traceback."""
import os
import subprocess
import sys

import pytest


def nagmoe(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "nagmoe", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


@pytest.mark.parametrize("args, needle", [
    (["config", "--config", "does/not/exist.yaml"], "does/not/exist.yaml"),
    (["config", "--config", "configs/tiny.yaml", "model.n_layerz=3"], "model.n_layerz"),
    (["config", "--config", "configs/tiny.yaml", "model.d_model=wide"], "model.d_model"),
    (["config", "--config", "configs/tiny.yaml", "model.n_layers"], "key.sub=value"),
    (["config"], "--config"),
])
def test_bad_input_exits_2_with_one_line(args, needle, repo_root):
    r = nagmoe(*args, cwd=repo_root)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("usage:")
             and not line.startswith("  ")]
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]


def test_config_prints_resolved_yaml(repo_root):
    r = nagmoe("config", "--config", "configs/tiny-prenorm.yaml", "model.n_layers=3", cwd=repo_root)
    assert r.returncode == 0, r.stderr
    assert "residual: prenorm" in r.stdout and "n_layers: 3" in r.stdout


def test_overrides_may_follow_options(repo_root):
    r = nagmoe("config", "--config", "configs/tiny.yaml", "model.n_layers=3", "--config", "configs/tiny.yaml",
               "model.d_model=64", cwd=repo_root)
    assert r.returncode == 0, r.stderr
    assert "n_layers: 3" in r.stdout and "d_model: 64" in r.stdout
    r = nagmoe("config", "--config", "configs/tiny.yaml", "model.n_layers=3", "--bogus", cwd=repo_root)
    assert r.returncode == 2 and "--bogus" in r.stderr


def test_building_the_command_line_imports_no_torch():
    """Every `nagmoe` call builds the whole parser (each command's add_arguments): that must stay light, so
    `--help`, a bad argument or a one-line refusal never waits for torch (about a second)."""
    import subprocess
    import sys

    code = "import sys, nagmoe.cli; nagmoe.cli.build_parser(); print(sorted(m for m in sys.modules if m == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-1000:]
    assert out.stdout.strip() == "[]"


def test_every_listed_command_exists_and_no_dead_one_is_listed():
    """`nagmoe --help` lists what runs (issue 54: it listed a `bench` that did not exist): every command has its
    module and runs `--help`; a name that is not a command is argparse's one line, exit 2."""
    from nagmoe.cli import COMMANDS

    listed = nagmoe("--help")
    assert listed.returncode == 0, listed.stderr
    for name in COMMANDS:
        assert f"    {name} " in listed.stdout or f"    {name}\n" in listed.stdout, name
        r = nagmoe(name, "--help")
        assert r.returncode == 0 and "usage: nagmoe" in r.stdout, (name, r.stderr[-500:])
    r = nagmoe("bench")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "invalid choice: 'bench'" in r.stderr
