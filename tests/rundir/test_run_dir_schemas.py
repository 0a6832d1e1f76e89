"""Issue 41, build item 8: every file read back from a run dir has a schema. A run dir outlives the process that
wrote it (requeues, copies, shared trees, hand edits), so `metrics.jsonl`, `summary.json`, `run_info.json`, a
checkpoint's `state.json` (and manifest), `preempted.json` and the report's cache OUT/data/<label>.json are
foreign input when read back. 100,000 nested brackets or a wrong type (a string `step`) in any of them is one
UserError naming the file and the field, from every reader of that file; a resume on such a file stops at start
with one line (exit 2) and nothing in the run dir lost; the report names such a run under Problems and renders
the others (exit 0), run labels included as given: `$...$` is not mathtext, a leading `_` stays in the legend.

No `nagmoe train` runs to the end here: `good_run` is a copy of the issue's end-to-end run (conftest.py); every
test works on a copy of it, and every train call here is refused at start."""
import hashlib
import json
import os
import shutil

import matplotlib.figure
import pytest
import torch

from nagmoe.cli import main
from nagmoe.base.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_MESSAGE = 4000  # nagmoe.base.errors.MAX_MESSAGE: the longest error or warning line
DEEP = "[" * 100_000  # RecursionError in json.loads on c9620be


def latest(run_dir):
    """The run's newest checkpoint dir (the one every reader and a resume use)."""
    from nagmoe.checkpoint.files import list_checkpoints

    return list_checkpoints(run_dir)[-1][1]


def state_file(run_dir):
    return os.path.relpath(os.path.join(latest(run_dir), "state.json"), run_dir)


def manifest_file(run_dir):
    return os.path.join(latest(run_dir), "manifest.json")


# ----------------------------------------------------------------------------------------------------------
# the good run and copies of it with one file broken
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def micro_args(request):
    data_dir, corpus = request.getfixturevalue("micro_data")
    root_conftest = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    return ["--config", os.path.join(REPO, "configs", "tiny.yaml"), *root_conftest.MICRO_OVERRIDES,
            f"data.corpus={corpus}", f"data.data_dir={data_dir}", "train.schedule_steps=4", "train.warmup_steps=0",
            "model.nag.warmup_tokens=0", "--quiet"]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory, request):
    """A finished run dir (checkpoints, metrics, summary, run_info): a copy of the issue's one end-to-end run,
    tests/support/taken_over_run.py's `taken_over_run` (its second trainer trained it to the end). The tests read
    nothing of it by step number; every one works on a further copy."""
    source = request.getfixturevalue("taken_over_run")
    assert source["outcome"]["second"]["exit"] == 0, source["outcome"]["second"]["stderr"]
    run_dir = str(tmp_path_factory.mktemp("good") / "run")
    shutil.copytree(source["run_dir"], run_dir)
    assert os.path.isfile(os.path.join(run_dir, state_file(run_dir)))
    return run_dir


def copy_of(good_run, parent, name):
    dst = os.path.join(str(parent), name)
    shutil.copytree(good_run, dst)
    return dst


def rewrite_line(path, number, edit):
    """Line `number` (1-based) of a JSON-lines file replaced by edit(record) (a dict, dumped) or a raw string."""
    with open(path) as f:
        lines = f.read().splitlines()
    new = edit(json.loads(lines[number - 1]))
    lines[number - 1] = new if isinstance(new, str) else json.dumps(new)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def edit_json(path, edit):
    with open(path) as f:
        obj = json.load(f)
    new = edit(obj)
    with open(path, "w") as f:
        f.write(new if isinstance(new, str) else json.dumps(new))


def edit_checkpoint_file(run_dir, rel, edit):
    """Edit a file of the checkpoint and re-record it in the manifest: the checkpoint still verifies, so only the
    file's schema stands between the edit and its readers."""
    edit_json(os.path.join(run_dir, rel), edit)
    ckpt, name = os.path.split(os.path.join(run_dir, rel))
    data = open(os.path.join(ckpt, name), "rb").read()
    manifest_path = os.path.join(ckpt, "manifest.json")
    manifest = json.load(open(manifest_path))
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    json.dump(manifest, open(manifest_path, "w"))


def with_marker(run_dir):
    marker = {"step": 2, "checkpoint": latest(run_dir), "reason": "SIGUSR1",
              "time": "2026-01-01T00:00:00+0000", "slurm_job_id": None, "slurm_restart_count": 0}
    with open(os.path.join(run_dir, "preempted.json"), "w") as f:
        json.dump(marker, f)


def snapshot(run_dir):
    """{relative path: bytes} of every file of the run dir but the lease (what a refused start must not change)."""
    out = {}
    for folder, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, run_dir)
            if rel != "lease.json":
                out[rel] = open(path, "rb").read()
    return out


# ----------------------------------------------------------------------------------------------------------
# every reader of every file kind
# ----------------------------------------------------------------------------------------------------------
def _readers():
    from nagmoe.analysis.report_cache import read_cache
    from nagmoe.analysis.report_data import read_run
    from nagmoe.checkpoint import latest_valid_checkpoint
    from nagmoe.checkpoint.files import read_checkpoint_state, verify_checkpoint
    from nagmoe.checkpoint.reader import checkpoint_format
    from nagmoe.checkpoint.resume import saved_layout
    from nagmoe.rundir.info import read_run_info, read_summary, update_run_info, write_run_info
    from nagmoe.rundir.metrics import read_metrics, truncate_metrics
    from nagmoe.train.preemption import read_marker

    ckpt = latest
    return {
        "metrics.jsonl": [lambda d: read_metrics(os.path.join(d, "metrics.jsonl")),
                          lambda d: truncate_metrics(os.path.join(d, "metrics.jsonl"), 1)],
        "summary.json": [read_summary],
        "run_info.json": [read_run_info, lambda d: write_run_info(d, {}, "cpu")],
        "state.json": [lambda d: read_checkpoint_state(ckpt(d)), lambda d: checkpoint_format(ckpt(d)),
                       lambda d: saved_layout(ckpt(d), d)],
        "manifest.json": [lambda d: verify_checkpoint(ckpt(d))],
        "preempted.json": [read_marker],
        "cache": [lambda d: read_cache(os.path.join(d, "cache.json"))],
    }, {"read_run": read_run, "update_run_info": update_run_info, "latest": latest_valid_checkpoint}


def _cache(run_dir):
    from nagmoe.checkpoint import latest_valid_checkpoint

    cache = {"run_dir": run_dir, "checkpoint": latest_valid_checkpoint(run_dir), "analysis_tokens": 0,
             "analysis": None, "eval_items": 2,
             "eval": {"tasks": [{"accuracy": 0.5, "centred": 1 / 3, "examples": 2}], "core_metric": 1 / 3}}
    with open(os.path.join(run_dir, "cache.json"), "w") as f:
        json.dump(cache, f)


# file kind -> (breakage name -> (break(run_dir), the field the message must name))
BREAKAGES = {
    "metrics.jsonl": {
        "deep": (lambda d: rewrite_line(os.path.join(d, "metrics.jsonl"), 1, lambda r: DEEP), "line 1"),
        "string step": (lambda d: rewrite_line(os.path.join(d, "metrics.jsonl"), 1, lambda r: {**r, "step": "1"}),
                        "'step'"),
        "not an object": (lambda d: rewrite_line(os.path.join(d, "metrics.jsonl"), 1, lambda r: "[1]"), "line 1"),
    },
    "summary.json": {
        "deep": (lambda d: edit_json(os.path.join(d, "summary.json"), lambda s: DEEP), "nested"),
        "string number": (lambda d: edit_json(os.path.join(d, "summary.json"), lambda s: {**s, "val_bpb": "1.5"}),
                          "'val_bpb'"),
        "string fractions": (lambda d: edit_json(os.path.join(d, "summary.json"),
                                                 lambda s: {**s, "executed_fractions": "all"}), "'executed_fractions'"),
    },
    "run_info.json": {
        "deep": (lambda d: edit_json(os.path.join(d, "run_info.json"), lambda s: DEEP), "nested"),
        "string previous": (lambda d: edit_json(os.path.join(d, "run_info.json"), lambda s: {**s, "previous": "x"}),
                            "'previous'"),
        "list": (lambda d: edit_json(os.path.join(d, "run_info.json"), lambda s: [s]), "object"),
    },
    "state.json": {
        "deep": (lambda d: edit_checkpoint_file(d, state_file(d), lambda s: DEEP), "nested"),
        "string step": (lambda d: edit_checkpoint_file(d, state_file(d), lambda s: {**s, "step": "2"}), "'step'"),
        "string progress": (lambda d: edit_checkpoint_file(d, state_file(d), lambda s: {
            **s, "extra": {**s["extra"], "progress": {**s["extra"]["progress"], "tokens": "512"}}}), "'tokens'"),
        "list layout": (lambda d: edit_checkpoint_file(d, state_file(d), lambda s: {**s, "layout": [1]}), "'layout'"),
    },
    "manifest.json": {
        "deep": (lambda d: edit_json(manifest_file(d), lambda s: DEEP), "nested"),
        "string bytes": (lambda d: edit_json(manifest_file(d), lambda s: {
            **s, "files": {k: {**v, "bytes": str(v["bytes"])} for k, v in s["files"].items()}}), "'bytes'"),
    },
    "preempted.json": {
        "deep": (lambda d: (with_marker(d), edit_json(os.path.join(d, "preempted.json"), lambda s: DEEP)), "nested"),
        "string step": (lambda d: (with_marker(d), edit_json(os.path.join(d, "preempted.json"),
                                                             lambda s: {**s, "step": "2"})), "'step'"),
    },
    "cache": {
        "deep": (lambda d: (_cache(d), edit_json(os.path.join(d, "cache.json"), lambda s: DEEP)), "nested"),
        "string accuracy": (lambda d: (_cache(d), edit_json(os.path.join(d, "cache.json"), lambda s: {
            **s, "eval": {"tasks": [{**s["eval"]["tasks"][0], "accuracy": "high"}]}})), "accuracy"),
        "string analysis": (lambda d: (_cache(d), edit_json(os.path.join(d, "cache.json"), lambda s: {
            **s, "analysis_tokens": 8, "analysis": {"residual": "nag", "depth": "deep"}})), "depth"),
    },
}
CASES = [(kind, name) for kind, breaks in BREAKAGES.items() for name in breaks]


@pytest.mark.parametrize("kind,breakage", CASES, ids=[f"{k}-{b}" for k, b in CASES])
def test_every_reader_names_the_file_and_field(kind, breakage, good_run, tmp_path):
    """Each reader of the broken file: a UserError naming the file and the field, one bounded line; the file as
    it was (a reader that writes, like the metrics truncation or write_run_info, wrote nothing)."""
    run_dir = copy_of(good_run, tmp_path, "run")
    (brk, field), path = BREAKAGES[kind][breakage], None
    brk(run_dir)
    readers, others = _readers()
    for read in readers[kind]:
        before = snapshot(run_dir)
        with pytest.raises(UserError) as caught:
            read(run_dir)
        message = str(caught.value)
        path = {"cache": "cache.json", "state.json": "state.json", "manifest.json": "manifest.json"}.get(kind, kind)
        assert path in message and field in message, message
        assert "\n" not in message and len(message) < 1000, message[:2000]
        assert snapshot(run_dir) == before
    if kind in ("metrics.jsonl", "summary.json", "run_info.json"):  # the report's reader: the run left out, named
        record, messages = others["read_run"](run_dir)
        assert record is None and len(messages) == 1 and path in messages[0] and "left out" in messages[0]
    if kind == "run_info.json":  # mid-run bookkeeping never rewrites a file it cannot read
        assert others["update_run_info"](run_dir, "backends_ran", {}) is False
    if kind == "state.json":  # pruning and listing do not depend on it: the checkpoint still verifies
        assert others["latest"](run_dir) == latest(run_dir)


def test_a_torn_last_metrics_line_is_what_a_crash_leaves_and_is_skipped(good_run, tmp_path):
    """A crash mid-append tears the last line (no newline): skipped, and dropped by the resume's truncation; the
    same text anywhere else is corruption (a UserError naming the line)."""
    from nagmoe.rundir.metrics import read_metrics, truncate_metrics

    path = os.path.join(copy_of(good_run, tmp_path, "run"), "metrics.jsonl")
    records = read_metrics(path)
    last = records[-1]["step"]
    with open(path, "a") as f:
        f.write(f'{{"step": {last + 1}, "tokens": 76')
    assert read_metrics(path) == records
    assert truncate_metrics(path, last) == len(records) and read_metrics(path) == records
    with open(path, "a") as f:
        f.write(f'{{"step": {last + 1}, "tokens": 76\n')  # with its newline: not a torn append
    with pytest.raises(UserError, match=rf"line {len(records) + 1}: not valid JSON"):
        read_metrics(path)


# ----------------------------------------------------------------------------------------------------------
# a resume on a broken file: one line, exit 2, nothing lost
# ----------------------------------------------------------------------------------------------------------
RESUME_CASES = [("metrics.jsonl", "string step"), ("metrics.jsonl", "deep"), ("run_info.json", "string previous"),
                ("run_info.json", "deep"), ("state.json", "string step"), ("state.json", "string progress")]


@pytest.mark.parametrize("kind,breakage", RESUME_CASES, ids=[f"{k}-{b}" for k, b in RESUME_CASES])
def test_a_resume_on_a_wrong_typed_file_is_one_line_and_loses_nothing(kind, breakage, good_run, micro_args,
                                                                    tmp_path, capsys):
    run_dir = copy_of(good_run, tmp_path, "run")
    brk, field = BREAKAGES[kind][breakage]
    brk(run_dir)
    before = snapshot(run_dir)
    torch.set_num_threads(1)
    code = main(["train", "--run-dir", run_dir, *micro_args, "train.max_steps=3", "train.checkpoint_every=2"])
    out, err = capsys.readouterr()
    assert code == 2, err[-3000:]
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and len(errors[0]) <= MAX_MESSAGE, err[-3000:]
    assert kind in errors[0] and field in errors[0], errors[0]
    assert snapshot(run_dir) == before  # nothing rewritten, truncated or lost


# the other commands that read a run dir's files: (file kind, breakage, argv after the run dir is known)
COMMANDS = {
    "flops": ("summary.json", "string fractions",
              lambda d: ["flops", "--config", os.path.join(d, "config.yaml"), "--run-dir", d]),
    "eval": ("state.json", "string step", lambda d: ["eval", "--run-dir", d, "--offline-items", "2", "--device",
                                                     "cpu"]),
    "analyze": ("state.json", "list layout", lambda d: ["analyze", "--run-dir", d, "--out",
                                                        os.path.join(d, "a.json"), "--tokens", "64", "--device",
                                                        "cpu"]),
    "consolidate": ("state.json", "string progress", lambda d: ["consolidate", d]),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_reading_the_file_says_one_line(command, good_run, tmp_path, capsys):
    kind, breakage, argv = COMMANDS[command]
    run_dir = copy_of(good_run, tmp_path, "run")
    brk, field = BREAKAGES[kind][breakage]
    brk(run_dir)
    torch.set_num_threads(1)
    code = main(argv(run_dir))
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err, err[-3000:]
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and kind in errors[0] and field in errors[0], err[-3000:]


# ----------------------------------------------------------------------------------------------------------
# the report over one good run and one broken run of each kind
# ----------------------------------------------------------------------------------------------------------
def _legend_spy(monkeypatch):
    """Every figure the report saves: its legends' texts and whether any is drawn as mathtext. The figures are
    drawn and saved for real; this only looks at them first."""
    seen = []
    real = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        texts = [t for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        titles = [ax.title for ax in fig.axes if ax.get_title()]
        seen.append({"labels": [t.get_text() for t in texts],
                     "math": [t.get_text() for t in texts + titles if t.get_parse_math() and "$" in t.get_text()],
                     "titles": [t.get_text() for t in titles]})
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return seen


def test_one_report_over_a_good_run_and_a_broken_run_of_each_kind(good_run, tmp_path, capsys, monkeypatch):
    """exit 0; the good runs rendered (labels with `$...$` and a leading `_` drawn as given, in the legend); each
    broken run named under Problems in one bounded line; nothing shows a Traceback."""
    from nagmoe.checkpoint import latest_valid_checkpoint

    runs = tmp_path / "runs"
    out = str(tmp_path / "report")
    good = [copy_of(good_run, runs, n) for n in ("good", "_lead", r"tex-$\frac{$-x")]
    broken = {}
    for label, (kind, breakage) in {"no-flops": ("metrics.jsonl", None), "deep-metrics": ("metrics.jsonl", "deep"),
                                    "string-step": ("metrics.jsonl", "string step"),
                                    "string-summary": ("summary.json", "string number"),
                                    "deep-summary": ("summary.json", "deep"),
                                    "bad-run-info": ("run_info.json", "string previous"),
                                    "bad-state": ("state.json", "string step")}.items():
        broken[label] = copy_of(good_run, runs, label)
        if breakage is None:  # a metrics line without `flops`
            rewrite_line(os.path.join(broken[label], "metrics.jsonl"), 1,
                         lambda r: {k: v for k, v in r.items() if k != "flops"})
        else:
            BREAKAGES[kind][breakage][0](broken[label])
    broken["bad-config"] = copy_of(good_run, runs, "bad-config")  # a long wrong value: a bounded message
    with open(os.path.join(broken["bad-config"], "config.yaml"), "a") as f:
        f.write(f"\nmodel:\n  d_model: {'x' * 100_000}\n")
    broken["cache-junk"] = copy_of(good_run, runs, "cache-junk")  # a planted cache the report would reuse
    os.makedirs(os.path.join(out, "data"))
    with open(os.path.join(out, "data", "cache-junk.json"), "w") as f:
        json.dump({"run_dir": broken["cache-junk"], "checkpoint": latest_valid_checkpoint(broken["cache-junk"]),
                   "analysis_tokens": 0, "analysis": None, "eval_items": 2,
                   "eval": {"tasks": [{"accuracy": "high", "centred": "low", "examples": 2}]}}, f)
    seen = _legend_spy(monkeypatch)
    torch.set_num_threads(1)
    code = main(["report", *good, *broken.values(), "--out", out, "--eval-items", "2", "--analysis-tokens", "0",
                 "--device", "cpu"])
    stdout, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "Traceback" not in stdout + err
    data = json.load(open(os.path.join(out, "report.json")))
    rendered = {os.path.basename(r["run_dir"]) for r in data["runs"].values()}
    assert rendered == {"good", "_lead", r"tex-$\frac{$-x", "bad-state", "cache-junk"}, rendered
    for label, run_dir in broken.items():
        named = [p for p in data["problems"] if label in p]
        assert named, (label, data["problems"])
    assert all(len(p) <= MAX_MESSAGE and "\n" not in p for p in data["problems"])
    assert any("cache-junk.json" in p and "accuracy" in p for p in data["problems"])
    assert any("bad-state" in p and "'step'" in p for p in data["problems"])  # its eval could not load it
    html = open(os.path.join(out, "report.html")).read()
    assert "x" * 1000 not in html
    loss = next(s for s in seen if "good" in s["labels"])  # the loss curves: every rendered run in its legend
    assert {"good", "_lead", r"tex-$\frac{$-x"} <= set(loss["labels"]) and not loss["math"], loss
    assert all(not s["math"] for s in seen)


def test_every_figure_draws_run_labels_as_given(tmp_path, monkeypatch):
    """Each figure that names run groups: a `$...$` label is text (never mathtext: this one would not even parse),
    and a label starting with `_` is in the legend (matplotlib leaves such artists out of an automatic legend)."""
    from nagmoe.analysis import figures as fig

    groups = ["_lead", r"tex-$\frac{$-x"]
    colours = fig.palette(groups)
    seen = _legend_spy(monkeypatch)
    drawn = {
        "loss_curves": fig.loss_curves({g: [([1, 2], [1, 2], [3.0, 2.0])] for g in groups}, colours,
                                       str(tmp_path / "a.png")),
        "val_bpb": fig.val_bpb_points({g: [[(1, 2.0)]] for g in groups}, colours, str(tmp_path / "b.png"), 3.0),
        "depth": fig.depth_panels({g: {"norm": [1, 2], "rotation": [0, 1], "bos": [0.5], "gain": [1.0],
                                       "kind": "nag"} for g in groups}, colours, str(tmp_path / "c.png")),
        "confidence": fig.confidence_panels({g: [{"mean": 1, "loss": 2, "top1_acc": 0.5}] for g in groups}, colours,
                                            str(tmp_path / "d.png")),
        "compute_dial": fig.compute_dial({g: [{"skip_rate": 0.1, "flops_vs_full_depth": 0.9, "val_bpb": 2.0}]
                                          for g in groups}, colours, str(tmp_path / "e.png"), {g: 2.0 for g in groups}),
        "router_load": fig.router_load_heatmaps({g: [[0.5, 0.5]] for g in groups}, str(tmp_path / "f.png")),
        "mod_skip_depth": fig.skip_through_depth({g: [0.1, 0.2] for g in groups}, str(tmp_path / "g.png")),
    }
    assert all(os.path.isfile(path) for path in drawn.values()), drawn
    by_name = dict(zip(drawn, seen))
    for name in ("loss_curves", "val_bpb", "depth", "confidence", "compute_dial"):
        labels = " | ".join(by_name[name]["labels"])
        assert all(g in labels for g in groups), (name, labels)
    for name in ("router_load", "mod_skip_depth"):
        assert all(any(g in t for t in by_name[name]["titles"]) for g in groups), by_name[name]
    assert all(not s["math"] for s in seen), seen

