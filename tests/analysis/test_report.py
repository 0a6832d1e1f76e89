"""`nagmoe experiment` + `nagmoe report` end to end on micro runs (subprocesses, OMP_NUM_THREADS=1): a 3-run x
2-seed experiment (pre-norm baseline, NAG, NAG + MoD 20%, a few steps each) renders every section with every
figure written, embedded and linked; a single run renders every section too; unusable run dirs give a clear
message while the others render; the page loads in headless Chromium without console errors."""
import base64
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from nagmoe.analysis.report import FIGURES, SECTIONS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 8  # training steps per run (the shared budget is this many steps of the micro NAG model)


def nagmoe(*args, check=True, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "-m", "nagmoe", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=timeout)
    if check and out.returncode != 0:
        pytest.fail(f"nagmoe {' '.join(map(str, args))} exited {out.returncode}:\n{out.stdout[-3000:]}\n"
                    f"{out.stderr[-3000:]}")
    return out


def micro_overrides(request):
    """tests/conftest.py's MICRO_OVERRIDES, read from that conftest's plugin (a plain `from conftest import` gets
    whichever conftest.py pytest loaded last)."""
    return request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py")).MICRO_OVERRIDES


def micro_experiment_yaml(path, micro, data_dir, corpus, name="micro", seeds=(0, 1), runs=None,
                          budget_steps=STEPS, extra=()):
    """An experiment file over the micro config (`micro`: MICRO_OVERRIDES); returns (path, flop budget)."""
    from nagmoe.config import load_config
    from nagmoe.flops import flops_per_token

    overrides = [o for o in micro if not o.startswith("train.max_steps")]
    overrides += [f"data.corpus={corpus}", f"data.data_dir={data_dir}", "train.eval_every=4", *extra]
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), overrides)
    budget = budget_steps * cfg.train.batch_tokens * flops_per_token(cfg.model, cfg.data.seq_len)
    runs = runs or {"baseline": {"config": os.path.join(REPO, "configs/tiny-prenorm.yaml")},
                    "nag": {"config": os.path.join(REPO, "configs/tiny.yaml")},
                    "nag-mod20": {"config": os.path.join(REPO, "configs/tiny.yaml"),
                                  "overrides": ["model.mod.skip_rate=0.2", "model.mod.start_tokens=512"]}}
    spec = {"name": name, "flop_budget": float(budget), "seeds": list(seeds), "overrides": overrides,
            "description": "micro experiment of the report tests",
            "report": {"eval_items": 16, "analysis_tokens": 1024}, "runs": runs}
    path.write_text(json.dumps(spec))  # JSON is YAML
    return str(path), budget


@pytest.fixture(scope="module")
def experiment(request, tmp_path_factory, micro_data):
    data_dir, corpus = micro_data
    root = tmp_path_factory.mktemp("experiment")
    path, budget = micro_experiment_yaml(root / "micro.yaml", micro_overrides(request), data_dir, corpus)
    out = nagmoe("experiment", path, "--runs-root", root / "runs", "--quiet")
    exp_dir = root / "runs" / "micro"
    return {"root": root, "dir": exp_dir, "stdout": out.stdout, "budget": budget,
            "html": (exp_dir / "report.html").read_text(), "json": json.loads((exp_dir / "report.json").read_text())}


def section(html, name):
    m = re.search(rf'<section id="{name}">(.*?)</section>', html, re.S)
    assert m, f"section {name} missing"
    return m.group(1)


def test_three_run_experiment_renders_every_section_and_figure(experiment):
    html, data, exp_dir = experiment["html"], experiment["json"], experiment["dir"]
    for s in SECTIONS:
        section(html, s)
    assert data["problems"] == []
    assert sorted(data["runs"]) == sorted(f"{r}-s{s}" for r in ("baseline", "nag", "nag-mod20") for s in (0, 1))
    assert set(data["figures"]) == set(FIGURES)  # every figure has something to draw with these three runs
    for name, rel in data["figures"].items():
        path = exp_dir / rel
        png = path.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f'href="figures/{name}.png"' in html  # linked file ...
        assert f"data:image/png;base64,{base64.b64encode(png).decode()}" in html  # ... and embedded, self-contained
    # FLOP-matched: one budget, every run within half a step of it
    assert f"{experiment['budget']:.4g} training FLOPs" in section(html, "overview")
    for g in data["groups"].values():
        for flops in g["flops"]:
            assert abs(flops - experiment["budget"]) <= 0.5 * experiment["budget"] / STEPS * 1.2
    # seed spread: two seeds -> mean ± sd (n=2) and a noise verdict per comparison
    results = section(html, "results")
    assert "± " in results and "(n=2)" in results and "unigram" in results
    comparisons = section(html, "comparisons")
    assert "NAG vs pre-norm baseline: nag vs baseline" in comparisons
    assert "MoD vs full depth: nag-mod20 vs nag" in comparisons
    assert re.search(r"below what 2 seeds resolve|ahead of|behind", comparisons)
    kinds = {(p["kind"], p["reference"], p["variant"]) for p in data["pairs"]}
    assert kinds == {("nag_vs_baseline", "baseline", "nag"), ("mod_vs_full", "nag", "nag-mod20")}
    # MoD table: the MoD run, its full-depth partner, and the paper's row labelled as theirs
    mod = section(html, "mod")
    assert "nag-mod20" in mod and "paper (theirs)" in mod and "60.9B vs 50B" in mod
    assert data["groups"]["nag-mod20"]["skip_rate"][0] > 0.05
    assert "inference skip rate" in section(html, "dial")
    # expert balance during training (issue 43): a row per run from its metrics' router telemetry
    balance = html.split("Expert balance during training")[1].split("</table>")[0]
    assert balance.count("<tr>") == 1 + 6 and "nag-mod20 (nag-mod20-s1)" in balance
    refs = section(html, "references")
    assert refs.count('class="theirs"') == 10 and "0.7503 vs 0.7589" in refs and "Figliolia" in refs
    assert "no matching pair" not in refs.split("NAG speed")[0]  # our side is filled for every measure above


def test_experiment_rerun_skips_finished_runs_and_reuses_measurements(experiment):
    out = nagmoe("experiment", experiment["root"] / "micro.yaml", "--runs-root", experiment["root"] / "runs",
                 "--quiet")
    assert out.stdout.count("finished already") == 6
    assert "analysing" not in out.stdout and "eval (" not in out.stdout  # cached per checkpoint under data/


def chromium_binary():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    if os.environ.get("CI"):
        pytest.fail("chromium not found and CI is set: .ci/run must `apt-get install chromium`")
    pytest.skip("chromium not installed (apt-get install chromium)")


# appended to a copy of the page: reports images that did not decode, then marks the DOM
PROBE = """<script>window.addEventListener("load", () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  if (ok !== imgs.length) console.error("broken images: " + (imgs.length - ok));
  document.body.setAttribute("data-probe", "images " + ok + "/" + imgs.length);
});</script>"""


def test_report_loads_in_headless_chromium_without_console_errors(experiment, tmp_path):
    binary = chromium_binary()
    page = tmp_path / "page.html"
    page.write_text(experiment["html"].replace("</body>", PROBE + "</body>"))
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console
    n = len(FIGURES)
    assert f'data-probe="images {n}/{n}"' in out.stdout  # the load handler ran and every figure decoded
    assert 'id="references"' in out.stdout


def test_single_run_report_renders_every_section(experiment, tmp_path):
    run = experiment["dir"] / "nag-mod20-s0"
    out = nagmoe("report", run, "--out", tmp_path / "one", "--eval-items", "8", "--analysis-tokens", "512")
    assert out.stdout.strip().endswith("report.html")
    html = (tmp_path / "one" / "report.html").read_text()
    data = json.loads((tmp_path / "one" / "report.json").read_text())
    for s in SECTIONS:
        section(html, s)
    assert "Only one run group: nothing to compare" in section(html, "comparisons")
    assert "(n=" not in section(html, "results") and "One seed per run" in section(html, "results")
    assert "no matching pair in this report" in section(html, "references")
    assert "nag-mod20" in section(html, "mod")  # its own row, without a full-depth partner
    for name, rel in data["figures"].items():
        assert (tmp_path / "one" / rel).is_file() and f'href="figures/{name}.png"' in html
    assert {"loss_curves", "depth", "compute_dial"} <= set(data["figures"])


def test_unusable_run_dirs_get_a_clear_message_and_the_others_render(experiment, tmp_path):
    good = experiment["dir"] / "nag-s0"
    no_train = tmp_path / "runs" / "fresh-s0"  # started, never logged a step: config only
    no_train.mkdir(parents=True)
    shutil.copy(good / "config.yaml", no_train / "config.yaml")
    no_ckpt = tmp_path / "runs" / "nockpt-s0"  # metrics and summary, but its checkpoints are gone
    no_ckpt.mkdir()
    for f in ("config.yaml", "metrics.jsonl", "summary.json"):
        shutil.copy(good / f, no_ckpt / f)
    missing = tmp_path / "runs" / "never-s0"
    out = nagmoe("report", good, no_train, no_ckpt, missing, "--out", tmp_path / "rep", "--eval-items", "8",
                 "--analysis-tokens", "512")
    assert f"{no_train}: no metrics.jsonl and no valid checkpoint: the run has not trained a step" in out.stderr
    assert f"{missing}: not found" in out.stderr
    assert f"{no_ckpt}: no valid checkpoint under checkpoints/" in out.stderr
    html = (tmp_path / "rep" / "report.html").read_text()
    problems = section(html, "problems")
    assert str(no_train) in problems and str(missing) in problems
    results = section(html, "results")
    assert ">nag<" in results and ">nockpt<" in results and "fresh" not in results  # groups of the usable dirs
    analysed, balance = section(html, "depth").split("Expert balance during training")
    assert "nockpt-s0" not in analysed  # no checkpoint: no analysis, but curves and numbers ...
    assert "nockpt (nockpt-s0)" in balance  # ... its metrics' router telemetry among them
    # nothing usable at all: a one-line error, exit 2, the page still written
    bad = nagmoe("report", no_train, missing, "--out", tmp_path / "none", check=False)
    assert bad.returncode == 2 and "no usable run dir among 2 given" in bad.stderr.splitlines()[-1]
    assert (tmp_path / "none" / "report.html").is_file()
