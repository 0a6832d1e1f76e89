"""Issue 39: the GPU check fits its lease. Its memory estimates are computed on a CPU ahead of time and committed
(tools/gpu_check/gpu_check_estimates.json): they must be current; a config or code change makes an entry stale; the GPU
sections' limits add up to the budget; the tools import one another without a circle. Issue 52: the estimates'
code digest is the same under every Python 3.10-3.13 found here (the GPU machine runs 3.12)."""
import ast
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools", "gpu_check")
PYTHONS = ("3.10", "3.11", "3.12", "3.13")  # 3.12: the GPU machine's (tools/gpu_check/gpu_check.sh)


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
    rerun `python tools/gpu_check/gpu_check_estimates.py --write` (under a minute) and commit the JSON."""
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


@functools.lru_cache(maxsize=None)
def _python(version: str):
    """An interpreter of `version` here (pyenv's, pythonX.Y on PATH, or this one), or None."""
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = sorted(glob.glob(os.path.join(pyenv, "versions", f"{version}.*", "bin", "python")))
    found += [p for p in (shutil.which(f"python{version}"), sys.executable) if p]
    for python in found:
        try:
            said = subprocess.run([python, "-E", "-S", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                  capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if said == version:
            return python
    return None


# what 3.12's tokenize splits differently: f-strings (nested, with format specs, on several lines), a name with a
# combining mark (tokenize before 3.12: NAME ERRORTOKEN NAME ...)
SAMPLE = ('def f(x):\n    """Doc."""\n    return g(x, f"{x!r:>{w}} {f\'{x}\'}", f"""a\n{x:{w}}\nb""")\n'
          '\u05e2\u05b4\u05d1\u05e8\u05b4\u05d9\u05ea = 1\n')


@pytest.mark.parametrize("version", PYTHONS)
def test_the_code_digest_is_the_same_under_each_python(estimates, version):
    """Issue 52: the estimates are computed under one Python and looked up under the GPU machine's (3.12); the code
    digest must not depend on which. It is computed by the standard library alone (-S: no torch, no nagmoe) under
    each Python found, and must equal this one's and the one the committed JSON's entries were computed with (their
    fingerprints against this Python's digest: test_the_committed_estimates_are_current)."""
    python = _python(version)
    if python is None:
        pytest.skip(f"no Python {version} here (looked in pyenv's versions, python{version} on PATH, this one)")
    here = f"Python {sys.version_info[0]}.{sys.version_info[1]}'s"
    run = subprocess.run([python, "-E", "-S", os.path.join(TOOLS, "gpu_check_estimates.py"), "--code-digest"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == estimates.code_digest(), (
        f"the code digest under Python {version} ({python}) differs from {here}: the estimates would read stale")
    sample = subprocess.run([python, "-E", "-S", "-c", f"import sys; sys.path.insert(0, {TOOLS!r}); "
                             f"import gpu_check_estimates as e; print(ascii(e.source_tokens({SAMPLE!a})))"],
                            capture_output=True, text=True, timeout=60)
    assert sample.stdout.strip() == ascii(estimates.source_tokens(SAMPLE)), (sample.stderr, f"{here} tokens")
    assert estimates.read().get("code_digest") == run.stdout.strip(), "JSON of other code: rerun its --write"


def test_the_code_digest_ignores_comments_and_line_breaks(estimates):
    tokens = estimates.source_tokens
    same = "# a comment\n" + SAMPLE.replace("(x):", "(x):  # why\n").replace("g(x, ", "g(\n        x,  ")
    assert tokens(SAMPLE) == tokens(same) and tokens(SAMPLE) != tokens(SAMPLE.replace("Doc.", "Other."))
    assert tokens(SAMPLE) != tokens(SAMPLE.replace("g(x", "h(x"))
    whole = ('STRING f"{x!r:>{w}} {f\'{x}\'}"', 'STRING f"""a\n{x:{w}}\nb"""', "NAME " + SAMPLE.split()[-3])
    assert set(whole) <= set(tokens(SAMPLE))  # one token each, whatever the Python


def _lists(branch: str) -> dict:
    """{"SECTIONS" | "LEASE" | "ON_REQUEST": {section: limit}, "FULL_BUDGET" | "LEASE_BUDGET": seconds} of one
    branch of tools/gpu_check/gpu_check.sh's `if [[ $MODE == cpu ]]`."""
    out = {name: {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", body)}
           for name, body in re.findall(r"\b(SECTIONS|LEASE|ON_REQUEST)=\(([^)]*)\)", branch)}
    out.update({k: int(v) for k, v in re.findall(r"\b(FULL_BUDGET|LEASE_BUDGET)=(\d+)", branch)})
    return out


def test_the_gpu_sections_fit_the_budget():
    script = open(os.path.join(TOOLS, "gpu_check.sh")).read()
    cpu_branch, gpu_branch = script.split("if [[ $MODE == cpu ]]; then\n", 1)[1].split("\nelse\n", 1)
    gpu, cpu = _lists(gpu_branch.split("\nfi\n", 1)[0]), _lists(cpu_branch)
    # issue 52: a bounded script time, so the call and a rerun of the sections that failed fit a 15-minute lease
    # (docs/benchmarks.md: the evidence behind each limit); the answers only a GPU gives first, the install last
    limits = gpu["SECTIONS"]
    assert gpu["FULL_BUDGET"] == 590 < 10 * 60 and sum(limits.values()) == gpu["FULL_BUDGET"], limits
    assert list(limits) == ["env", "data", "train_nag", "train_baseline", "train_nag_mod20", "mod_speed", "profile",
                            "resume", "tests", "dcp", "install"]  # each training config its own process
    assert limits["mod_speed"] == 80 and limits["profile"] == 120  # issues 59 and 60's sections
    # issue 69: --lease, what one 15-minute lease answers (MoD against NAG in one process) with room for a whole
    # rerun beside the machine's start (1-2 minutes): 2 x the list + 120 s within 900 s
    lease = gpu["LEASE"]
    assert list(lease) == ["env", "data", "train_nag", "train_nag_mod20", "mod_speed"], lease
    assert sum(lease.values()) == gpu["LEASE_BUDGET"] == 325 and 2 * 325 + 120 <= 900
    assert lease["mod_speed"] == 150 and all(lease[k] >= limits[k] for k in lease)  # no limit below the full list's
    assert sum(cpu["SECTIONS"].values()) == cpu["FULL_BUDGET"] == 285 and "mod_block" not in cpu["SECTIONS"]
    assert list(cpu["LEASE"]) == list(lease) and sum(cpu["LEASE"].values()) == cpu["LEASE_BUDGET"] == 145
    assert list(cpu["ON_REQUEST"]) == list(gpu["ON_REQUEST"]) == ["mod_block"]  # mod_block: by name only


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


def test_a_compile_failure_is_recorded_first_and_the_eager_rerun_runs_in_a_fresh_process(estimates, tmp_path):
    """The compile error reaches bench.json before anything else is tried; the eager rerun (train.compile=false
    model.nag.impl=eager) runs in a new process (a sticky CUDA error may have poisoned this one), which writes
    the section's entry itself. Here that process fails on purpose (GPU_CHECK_FAIL): the entry still says which
    try failed and keeps the compile error."""
    import json

    import torch

    import gpu_check_train
    from gpu_check_common import Ctx, put

    cfg = SimpleNamespace(train=SimpleNamespace(compile=True))
    calls = []

    def run(extra, suffix):
        calls.append(extra)
        raise RuntimeError("inductor: a compile error")

    ctx = Ctx("train_nag", "cpu", str(tmp_path), str(tmp_path), limit=120)
    put(ctx.out, ctx.name, {"status": "running", "limit": 120})
    os.environ["GPU_CHECK_FAIL"] = "train_nag"  # the fresh process's section fails at its start
    try:
        with pytest.raises(gpu_check_train.Delegated) as e:
            gpu_check_train.with_eager_fallback(ctx, lambda extra: cfg, run, torch.device("cpu"))
    finally:
        del os.environ["GPU_CHECK_FAIL"]
    assert calls == [[]] and e.value.rc == 1  # this process tried the compiled run only
    entry = json.loads((tmp_path / "bench.json").read_text())["sections"]["train_nag"]
    assert entry["status"] == "failed" and "deliberate failure" in entry["error"], entry
    assert entry["result"]["compile_error"] == "RuntimeError: inductor: a compile error", entry
    assert entry["limit"] == 120 and entry["seconds"] >= 0

    # the fresh process's side: the config eager, NAG's maths eager too
    eager = Ctx("train_nag", "cpu", str(tmp_path), str(tmp_path), limit=120, eager=True)
    res = gpu_check_train.with_eager_fallback(eager, lambda extra: cfg, lambda extra, suffix: {"ran": extra},
                                              torch.device("cpu"))
    assert res["compile"] == "eager fallback" and res["ran"] == ["train.compile=false", "model.nag.impl=eager"]


@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_every_config_the_check_trains_loads_at_its_size(estimates, mode):
    """Each config a section trains validates at that size before any GPU work: at the GPU's size the resume's
    first half (2 steps of 65536 tokens) was as long as the injection warm-up (2 steps), and the config refused
    it only after the straight run had spent its GPU time (issue 52's first GPU run: "model.nag.warmup_tokens:
    131072 must be below the run's budget")."""
    import gpu_check_train
    from gpu_check_configs import PAPER, SIZES, paper_config

    import gpu_check_mod

    for key in PAPER:
        assert paper_config(key, mode, "/nonexistent").train.batch_tokens == SIZES[mode]["batch_tokens"]
    # mod_speed's MoD config (--cpu: the GPU's static implementation)
    assert paper_config(gpu_check_mod.KEY, mode, "/nonexistent", gpu_check_mod.MOD_IMPL[mode]).model.mod.impl == (
        "static" if mode == "cpu" else "auto")
    n = SIZES[mode]["resume_steps"]
    configs = gpu_check_train.resume_configs(lambda extra: gpu_check_train.resume_config(mode, "/nonexistent", extra),
                                             n)
    assert sorted(configs) == [n // 2, n] and all(c.model.n_layers == 4 for c in configs.values())


def test_mod_speed_times_micro_steps_and_pins_the_dialled_thresholds(estimates):
    """Issue 69's mod_speed, its parts on toys: each micro-step's forward+backward is timed by hooks alone; the
    dial's thresholds stay pinned through the calibrator's update (the counts still fold in) until released."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    import gpu_check_mod
    from nagmoe.model.mod_calibration import MoDCalibrator

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = nn.Linear(16, 16), nn.Linear(16, 96)

        def forward(self, x):
            return SimpleNamespace(loss=self.head(x + self.attn(x)).logsumexp(-1).mean())

    model, x = Toy(), torch.randn(32, 16)
    micro = gpu_check_mod.MicroSteps(model, torch.device("cpu"))
    for _ in range(2):
        model(x).loss.backward()
    with torch.no_grad():
        model(x)  # no backward: no micro-step
    assert len(seconds := micro.take()) == 2 and all(s > 0 for s in seconds) and micro.take() == []
    micro.close()

    cal = MoDCalibrator(4, 0.2, [True] * 4, mode="global", work_weights=[1.0, 3.0, 1.0, 3.0])
    gen = torch.Generator().manual_seed(0)

    def step(scale):  # one training step's scores, then the update the trainer calls
        for i in range(4):
            cal.select(i, scale * torch.rand(4, 64, generator=gen))
        cal.update()

    step(1.0)
    cal.set_skip_rate(0.2)
    dialled, hist = cal.threshold.clone(), cal.histogram.clone()
    pinned = gpu_check_mod.PinnedThresholds(cal)
    step(0.5)  # lower scores: an unpinned update would lower the thresholds
    assert torch.equal(cal.threshold, dialled) and bool(cal.skipping.all())
    assert not torch.equal(cal.histogram, hist)  # the step's counts folded in
    pinned.close()
    step(0.5)
    assert not torch.equal(cal.threshold, dialled) and "update" not in vars(cal)
    got = gpu_check_mod.skips(cal, [[1.0, 0.5, 0.8, 0.7], [1.0, 0.7, 0.6, 0.5]], moe=True)
    assert got["moe_skip"] == pytest.approx(0.4) and got["attention_skip"] == pytest.approx(0.15)
    assert got["skip_rate_work"] == pytest.approx((0.3 * 1 + 2 * 0.4 * 3) / 8)


def test_mod_speed_answers_against_nag_and_both_shares(estimates):
    """The answer from timed phases: MoD / NAG per rate; the saving at 0.2 against skip x share for the eligible
    sublayers and for the expert GEMMs alone; issue 59's bar held against the expert GEMMs (what static skips)."""
    import gpu_check_mod

    rates = {"0": {"step_s": 1.1}, "0.2": {"step_s": 1.0, "skip_rate_work": 0.2, "moe_skip": 0.25},
             "0.5": {"step_s": 0.8, "skip_rate_work": 0.5, "moe_skip": 0.5}}
    out = {"nag": {"step_s": 1.0}, "rates": rates, "share_eligible": 0.8, "share_experts": 0.3}
    got = gpu_check_mod.answer(out)
    at = got["answer"]["0.2"]
    assert got["mod20_over_nag"] == pytest.approx(1.0) and got["answer"]["0"]["mod_over_nag"] == pytest.approx(1.1)
    assert at["saved"] == pytest.approx(1 - 1.0 / 1.1) == got["saved_0_2"]
    assert at["target_eligible"] == pytest.approx(0.16) and at["target_experts"] == pytest.approx(0.075)
    assert at["realised_vs_experts"] == pytest.approx((1 - 1.0 / 1.1) / 0.075)
    assert got["meets_0_9"] is True  # 0.0909 >= 0.9 x 0.075
    assert gpu_check_mod.answer({**out, "share_experts": None})["meets_0_9"] is None  # no profile yet
    line = gpu_check_mod.summary_line({**out, **got, "mod_impl": "static", "compile": "on"})
    assert line.startswith("MoD speed (static, on): MoD/NAG step at 0/0.2/0.5: 1.100/1.000/0.800 (NAG 1 s)")
    assert "saved at 0.2 0.0909 vs experts' target 0.075 (share 0.3)" in line and "meets 0.9 True" in line
