"""Issue 69 item 6: tools/ holds three kinds of tool (the pipeline's commands in tools/, the GPU check in
tools/gpu_check/, the benchmarks and counters in tools/bench/). Every `tools/...` path the README, the Makefile, the
docs and the code name must exist, so that a command a reader copies runs and a later move cannot leave a stale one.
docs/decisions.md is left out: a log that quotes each decision's commands as they were on its day."""
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# docs/decisions.md: history; this file: it names the paths from before the move on purpose
HISTORICAL = ("tests/test_tool_paths.py",)
# `tools/` then a path; not the tail of another path (`x/tools/...`) or a name (`mytools/`)
TOOL_PATH = re.compile(r"(?<![\w./-])tools/[\w./*-]*")


def named_files() -> list[str]:
    """The files that name tools: the README, the Makefile, setup.py, pytest.ini, the docs, and every Python or
    shell file of the package, the tools, the tests, the launch templates and CI."""
    files = ["README.md", "Makefile", "setup.py", "pytest.ini", *sorted(glob.glob("docs/*.md", root_dir=REPO))]
    for folder in ("nagmoe", "tools", "tests", "launch", ".ci"):
        for path in sorted(glob.glob(f"{folder}/**/*", root_dir=REPO, recursive=True)):
            if path.endswith((".py", ".sh", ".sbatch")) or path.startswith(".ci/"):
                files.append(path)
    return [f for f in files if f not in HISTORICAL and os.path.isfile(os.path.join(REPO, f))]


def tool_paths(text: str) -> set[str]:
    """Each `tools/...` path in `text`, without the punctuation of the sentence around it."""
    return {m.group(0).rstrip(".,:;") for m in TOOL_PATH.finditer(text)}


def missing(text: str) -> list[str]:
    """The paths `text` names that this checkout lacks (a `*` is a pattern: it must match a file)."""
    return sorted(p for p in tool_paths(text)
                  if not (glob.glob(p, root_dir=REPO) if "*" in p else os.path.exists(os.path.join(REPO, p))))


def test_every_tool_path_named_exists():
    stale, named = [], set()
    for rel in named_files():
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            text = f.read()
        named |= tool_paths(text)
        stale += [f"{rel}: {p}" for p in missing(text)]
    assert stale == []
    # the scan sees the three kinds (a regex that matched nothing would pass the check above)
    assert {"tools/demo.py", "tools/gpu_check/gpu_check.sh", "tools/bench/bench_mod.py"} <= named


@pytest.mark.parametrize("text, stale", [
    ("bash tools/gpu_check.sh --cpu", "tools/gpu_check.sh"),
    ("`python tools/bench_mod.py --block`", "tools/bench_mod.py"),
    ("(tools/step_profile.py: regions).", "tools/step_profile.py"),
    ("the estimates (tools/gpu_check_estimates.json, committed)", "tools/gpu_check_estimates.json"),
    ("sections (tools/gpu_check_*.py)", "tools/gpu_check_*.py"),
])
def test_a_path_from_before_the_move_is_stale(text, stale):
    """The names before issue 69's move, as the README and the docs wrote them: each is reported."""
    assert missing(text) == [stale]
    assert missing(text.replace("tools/", "tools/gpu_check/" if "gpu_check" in stale else "tools/bench/")) == []


def test_each_kind_of_tool_has_its_folder():
    """The GPU check's files in tools/gpu_check/, the benchmarks and counters in tools/bench/, none of either left
    among the pipeline's commands in tools/."""
    def names(folder):
        return {n for n in os.listdir(os.path.join(REPO, folder)) if n.endswith((".py", ".sh", ".json"))}

    check, bench, top = names("tools/gpu_check"), names("tools/bench"), names("tools")
    assert {"gpu_check.sh", "gpu_check_sections.py", "gpu_check_estimates.json"} <= check
    assert all(n.startswith("gpu_check") for n in check), check
    assert {"bench_suite.py", "count_syncs.py", "count_bookkeeping.py", "step_profile.py"} <= bench
    assert not [n for n in bench if n.startswith("gpu_check")], bench
    assert {"demo.py", "install_corpus.py"} <= top
    assert not [n for n in top if n.startswith(("gpu_check", "bench_", "count_", "step_profile"))], top
