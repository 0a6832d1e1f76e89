"""Issue 39: the GPU check fits its lease. Its memory estimates are computed on a CPU ahead of time and committed
(tools/gpu_check_estimates.json): they must be current; a config or code change makes an entry stale; the GPU
sections' limits add up to the budget; the tools import one another without a circle."""
import ast
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools")


@pytest.fixture(scope="module")
def estimates():
    sys.path.insert(0, TOOLS)
    try:
        import gpu_check_estimates

        yield gpu_check_estimates
    finally:
        sys.path.remove(TOOLS)


def test_the_committed_estimates_are_current(estimates):
    """Fails when the model, the estimator, the rules tier or a check config changed since the JSON was written:
    rerun `python tools/gpu_check_estimates.py --write` (under a minute) and commit the JSON."""
    assert estimates.problems() == []
    entries = estimates.read()["entries"]
    assert set(entries) == {estimates.key(n, r) for n in estimates.PAPER for r in estimates.RULES}
    for entry in entries.values():
        assert entry["layout"]["cuda_rules"] == entry["cuda_rules"] and entry["total"] == sum(entry["parts"].values())


def test_a_changed_config_or_code_makes_an_entry_stale(estimates, monkeypatch):
    configs = estimates.gpu_configs()
    rules = estimates.RULES[0]
    assert "bytes" in estimates.lookup("nag", configs["nag"], rules)
    wider = estimates.paper_config("nag", "gpu", "/nonexistent", ["train.micro_batch_tokens=16384"])
    assert "stale" in estimates.lookup("nag", wider, rules)
    assert "missing" in estimates.lookup("nag", configs["nag"], "2.13")  # no entry for another torch's rules
    monkeypatch.setattr(estimates, "code_digest", lambda: "the model's code changed")
    found = estimates.lookup("nag", configs["nag"], rules)
    assert "stale" in found and found["bytes_when_computed"] > 0


def test_the_gpu_sections_fit_the_budget():
    script = open(os.path.join(TOOLS, "gpu_check.sh")).read()
    gpu = script.split("\nelse\n", 1)[1]  # the GPU branch of `if [[ $MODE == cpu ]]`
    budget = int(re.search(r"GPU_CHECK_BUDGET:-(\d+)\}", gpu).group(1))
    limits = dict(re.findall(r"(\w+):(\d+)", gpu.split("SECTIONS=(", 1)[1].split(")", 1)[0]))
    assert budget == 350 and sum(map(int, limits.values())) <= budget, limits
    assert {"train_baseline", "train_nag", "train_nag_mod20"} <= set(limits)  # each config its own process


def test_the_gpu_check_tools_import_without_a_circle():
    graph = {}
    for name in os.listdir(TOOLS):
        if name.startswith("gpu_check") and name.endswith(".py"):
            tree = ast.parse(open(os.path.join(TOOLS, name)).read())
            mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            graph[name[:-3]] = {m for m in mods if m.startswith("gpu_check")}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))

    assert len(graph) >= 5 and not [m for m in graph if reaches(m, m)], graph


def test_a_gpu_without_the_fast_grouped_mm_is_warned_about(estimates):
    import gpu_check_train

    assert gpu_check_train.grouped_mm_warning("NVIDIA H200", (9, 0)) == []
    assert gpu_check_train.grouped_mm_warning("NVIDIA B200", (10, 0)) == []
    (warning,) = gpu_check_train.grouped_mm_warning("NVIDIA A100-SXM4-80GB", (8, 0))
    assert warning.startswith("NVIDIA A100-SXM4-80GB is sm80") and "host sync per call" in warning


def test_the_eager_rerun_after_a_compile_failure_needs_half_the_limit(estimates, tmp_path):
    """A compile failure earns an eager rerun only while half the section's limit is left: a late failure's rerun
    would be killed part-way and its time lost to the sections after it."""
    import time
    from types import SimpleNamespace

    import torch

    import gpu_check_train
    from gpu_check_common import Ctx

    cfg = SimpleNamespace(train=SimpleNamespace(compile=True))
    calls = []

    def run(extra, suffix):
        calls.append(extra)
        if not extra:
            raise RuntimeError("inductor: a compile error")
        return {"losses": [1.0]}

    early = Ctx("train_nag", "cpu", str(tmp_path), str(tmp_path), limit=60)
    res = gpu_check_train.with_eager_fallback(early, lambda extra: cfg, run, torch.device("cpu"))
    assert res["compile"] == "eager fallback" and res["compile_error"].startswith("RuntimeError: inductor")
    assert calls == [[], ["train.compile=false"]]
    late = Ctx("train_nag", "cpu", str(tmp_path), str(tmp_path), limit=60)
    late.t0 = time.time() - 40  # 20 s of 60 left
    with pytest.raises(RuntimeError, match="no eager rerun"):
        gpu_check_train.with_eager_fallback(late, lambda extra: cfg, run, torch.device("cpu"))
    assert calls[-1] == []  # the compiled try only
