"""Issue 40, "one safe writer": run dirs, report dirs and a checkpoint's folder live in shared, group-writable
trees where another user can plant a name before nagmoe writes it. A symlink or a hard link to a victim file planted
at every name nagmoe used to write through (fixed or pid-suffixed temporaries) and at every final name leaves the
victim unchanged: whole files go through a fresh `.NAME.tmp-<random>` (O_EXCL|O_NOFOLLOW) renamed over the name
(exit 0), the in-place `metrics.jsonl` is refused (exit 2, one line naming it). The writer forced onto a planted
name does not follow it; no module of nagmoe/ writes a file any other way (an `ast` scan); under `umask 027` the
files are 0640 and the directories 0750 (not mkstemp's 0600); a run dir and its checkpoints/ that are symlinks to
other folders keep working. The real entry points run in this process (`nagmoe.cli.main`) on the micro config;
`nagmoe train` runs to the end twice (`the_run`: a start and its resume), every other train call here is refused."""
import ast
import itertools
import json
import os
import secrets
import shutil
import stat

import pytest
import torch
import yaml

from nagmoe.cli import main
from nagmoe.base.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VICTIM_TEXT = "# another user's file: nagmoe must never write it\n"  # YAML: nothing; JSON: invalid
KINDS = ("symlink", "hardlink")


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "elsewhere" / "victim.txt"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return str(path)


def plant(path, victim, kind):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    (os.symlink if kind == "symlink" else os.link)(victim, path)


def assert_untouched(victim, planted=()):
    with open(victim, "rb") as f:
        now = f.read()
    assert now == VICTIM_TEXT.encode(), f"the victim was written through a planted link: now {now[:60]!r}"
    for path in planted:  # a final name now holds our own file: a regular file of one link, not the victim
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_ino != os.stat(victim).st_ino, path


@pytest.fixture(scope="module")
def micro_args(request, tmp_path_factory):
    """`nagmoe train` arguments (config and overrides) of the micro config on the session's prepared data."""
    data_dir, corpus = request.getfixturevalue("micro_data")
    root_conftest = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    return ["--config", os.path.join(REPO, "configs", "tiny.yaml"), *root_conftest.MICRO_OVERRIDES,
            f"data.corpus={corpus}", f"data.data_dir={data_dir}", "train.schedule_steps=4", "train.warmup_steps=0",
            "model.nag.warmup_tokens=0", "--quiet"]


def run_cli(capsys, argv):
    """(exit code, stderr) of `nagmoe ARGV` in this process."""
    torch.set_num_threads(1)
    code = main(argv)
    return code, capsys.readouterr().err


def train(capsys, micro_args, run_dir, *overrides, force=False):
    return run_cli(capsys, ["train", "--run-dir", run_dir, *micro_args, *overrides, *(["--start-over"] * force)])


def one_line_error(code, err, *fragments):
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


# ----------------------------------------------------------------------------------------------------------
# the run: the two end-to-end `nagmoe train` runs of this module (a fresh start and its resume), made as a shared
# scratch tree makes them: the run dir and its checkpoints/ are symlinks to other folders, the umask is 027, and a
# link to a victim sits at every name c9620be wrote through (symlinks before the start, hard links before the
# resume). Every other test copies its result (`copy_run`) and never trains to the end.
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def the_run(micro_args, tmp_path_factory):
    root = tmp_path_factory.mktemp("safe_writes")
    victim = root / "elsewhere" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    victim = str(victim)
    scratch = root / "scratch"
    (scratch / "run").mkdir(parents=True)
    (scratch / "ckpts").mkdir()
    os.symlink(scratch / "ckpts", scratch / "run" / "checkpoints")
    run_dir = str(root / "run")
    os.symlink(scratch / "run", run_dir)
    ck, pid = os.path.join(run_dir, "checkpoints"), os.getpid()
    result = {"run_dir": run_dir, "scratch": str(scratch), "victim": victim}

    # the start: fixed temporaries, pid-suffixed ones, the save's directory, the prune's rename, and every final
    start_temps = [os.path.join(run_dir, n) for n in ("config.yaml.tmp", "run_info.json.tmp", "summary.json.tmp",
                                                       f"lease.json.tmp-{pid}")]
    start_temps += [os.path.join(ck, f"step_00000{s}.tmp-{pid}") for s in (1, 2)]
    start_temps += [os.path.join(ck, f"step_000001.del-{pid}")]
    start_finals = [os.path.join(run_dir, n) for n in ("config.yaml", "run_info.json", "summary.json", "lease.json")]
    # the resume: the same temporaries again, its metrics rewrite's, the next save's, the prune's; and the one final
    # name a resume writes without reading it first
    resume_temps = start_temps[:4] + [os.path.join(run_dir, f"metrics.jsonl.tmp-{pid}"),
                                      os.path.join(ck, f"step_000003.tmp-{pid}"),
                                      os.path.join(ck, f"step_000002.del-{pid}")]
    resume_finals = [os.path.join(run_dir, "summary.json")]
    args = ["train", "--run-dir", run_dir, *micro_args, "train.checkpoint_every=1", "train.keep_checkpoints=1"]
    old_umask = os.umask(0o027)
    try:
        torch.set_num_threads(1)
        for path in start_temps + start_finals:
            plant(path, victim, "symlink")
        # --start-over: the planted run_info/summary/checkpoints entries look like an earlier run's history
        result["start"] = main([*args, "train.max_steps=2", "--start-over"])
        result["start_finals"] = [p for p in start_finals if os.path.lexists(p)]  # lease.json: removed at the end
        result["start_victim"] = open(victim, "rb").read()
        result["start_info"] = json.load(open(os.path.join(run_dir, "run_info.json")))
        for path in resume_temps + resume_finals:
            if os.path.lexists(path):
                os.remove(path)
            plant(path, victim, "hardlink")
        result["resume"] = main([*args, "train.max_steps=3"])
        result["resume_finals"] = resume_finals
        result["planted"] = {os.path.basename(p) for p in start_temps + resume_temps}  # still there: not ours
    finally:
        os.umask(old_umask)
    return result


def copy_run(the_run, tmp_path, name="run"):
    """A private copy of the run without the planted names (its checkpoints/ copied, not linked: the tests may write
    there)."""
    dst = str(tmp_path / name)
    shutil.copytree(the_run["run_dir"], dst, symlinks=False,
                    ignore=lambda _, names: [n for n in names if n in the_run["planted"]])
    return dst


# ----------------------------------------------------------------------------------------------------------
# (a) links planted at the old temporaries and at the final names
# ----------------------------------------------------------------------------------------------------------
def test_links_at_the_run_dirs_names_leave_the_victim_unchanged(the_run):
    """A symlink at every name of the start and a hard link at every name of the resume: exit 0, the victim
    unchanged, each final name our own file (not the victim's inode), the history never read from the victim."""
    victim, run_dir = the_run["victim"], the_run["run_dir"]
    assert the_run["start_victim"] == VICTIM_TEXT.encode(), "the start wrote through a planted symlink"
    assert the_run["start"] == 0
    assert the_run["start_info"]["previous"] == []  # the victim's text was never taken for a history
    assert the_run["resume"] == 0
    assert_untouched(victim, the_run["start_finals"] + the_run["resume_finals"])
    assert yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))["train"]["max_steps"] == 3
    assert json.load(open(os.path.join(run_dir, "summary.json")))
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000003", "manifest.json"))
    assert [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))
            if '"step"' in line][-1] == 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_link_at_metrics_jsonl_exits_2_naming_it(kind, victim, the_run, micro_args, tmp_path, capsys):
    from nagmoe.rundir.metrics import MetricsWriter

    run_dir = copy_run(the_run, tmp_path)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    os.remove(metrics)
    plant(metrics, victim, kind)
    code, err = train(capsys, micro_args, run_dir, "train.max_steps=4")  # a resume: its rewrite, then its append
    assert_untouched(victim)
    one_line_error(code, err, metrics, "link")
    assert os.path.isfile(os.path.join(run_dir, "checkpoints", "step_000003", "manifest.json"))  # nothing lost
    # the append itself (a fresh run's): refused before a byte is written
    with pytest.raises(UserError, match="link"):
        MetricsWriter(run_dir).write({"step": 99, "loss": 1.0})
    assert_untouched(victim)
    assert os.path.islink(metrics) or os.stat(metrics).st_nlink == 2  # the planted name itself is left alone


@pytest.mark.parametrize("kind", KINDS)
def test_links_at_the_reports_names_leave_the_victim_unchanged(kind, victim, the_run, tmp_path, capsys):
    out = str(tmp_path / "report")
    old_temps = [os.path.join(out, n) for n in ("report.html.tmp", "data/run.json.tmp")]
    finals = [os.path.join(out, n) for n in ("report.html", "report.json", "data/run.json",
                                             "figures/loss_curves.png", "figures/val_bpb.png")]
    for path in old_temps + finals:
        plant(path, victim, kind)
    code, err = run_cli(capsys, ["report", the_run["run_dir"], "--out", out, "--eval-items", "2",
                                 "--analysis-tokens", "0", "--device", "cpu"])
    assert_untouched(victim)
    assert code == 0, err[-3000:]
    assert_untouched(victim, [p for p in finals if os.path.lexists(p)])  # a figure with nothing to show: removed
    assert json.load(open(finals[1]))["runs"]["run"]["run_dir"] == the_run["run_dir"]
    assert json.load(open(finals[2]))["eval"]
    with open(finals[3], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kind", KINDS)
def test_links_at_consolidated_pt_and_user_named_out_files_leave_the_victim_unchanged(kind, victim, the_run,
                                                                                    tmp_path, capsys):
    from nagmoe.checkpoint.consolidate import load_consolidated
    from nagmoe.checkpoint.deepspeed_layout import OWN_FILE, write_own_state

    run_dir = copy_run(the_run, tmp_path)
    consolidated = os.path.join(run_dir, "consolidated.pt")
    plant(f"{consolidated}.tmp-{os.getpid()}", victim, kind)
    plant(consolidated, victim, kind)
    code, err = run_cli(capsys, ["consolidate", run_dir])
    assert_untouched(victim)
    assert code == 0, err[-3000:]
    assert_untouched(victim, [consolidated])
    assert load_consolidated(consolidated)[0].train.max_steps == 3

    analysis, results = str(tmp_path / "analysis.json"), str(tmp_path / "eval.json")  # user-named --out files
    plant(analysis, victim, kind)
    plant(results, victim, kind)
    code, err = run_cli(capsys, ["analyze", "--run-dir", run_dir, "--tokens", "256", "--device", "cpu",
                                 "--out", analysis])
    assert code == 0, err[-3000:]
    code, err = run_cli(capsys, ["eval", "--run-dir", run_dir, "--tasks", "shakespeare", "--offline-items", "2",
                                 "--device", "cpu", "--out", results])
    assert code == 0, err[-3000:]
    assert_untouched(victim, [analysis, results])
    assert json.load(open(analysis))["tokens"] and json.load(open(results))["tasks"]

    # the DeepSpeed engine's own per-rank file, written into its save's directory
    own = os.path.join(str(tmp_path / "ds_step"), OWN_FILE.format(rank=0))
    plant(own, victim, kind)
    write_own_state(os.path.dirname(own), 0, {"w": torch.ones(2)}, [], None)
    assert_untouched(victim, [own])
    assert torch.load(own, weights_only=True)["params"]["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_link_at_the_preflights_summary_leaves_the_victim_unchanged(kind, victim, micro_args, tmp_path, capsys):
    from nagmoe.config import dump_yaml, load_config

    directory = tmp_path / "preflight"
    (directory / "slurm").mkdir(parents=True)
    cfg = load_config(micro_args[1], [a for a in micro_args if "=" in a])
    (directory / "slurm" / "config.yaml").write_text(dump_yaml(cfg))
    summary = str(directory / "summary.json")
    plant(summary, victim, kind)
    code, err = run_cli(capsys, ["preflight", "--dir", str(directory), "--steps", "1"])
    assert_untouched(victim)
    assert code in (0, 1), err[-3000:]  # 1: a check failed (this machine's numbers), not an error
    assert_untouched(victim, [summary])
    assert json.load(open(summary))["verdict"] in ("PASS", "FAIL")


# ----------------------------------------------------------------------------------------------------------
# (b) the writer forced onto a planted name
# ----------------------------------------------------------------------------------------------------------
PLANTED = "feedfacecafe"


def _writers(the_run, micro_args):
    """name -> (write(run_dir), [names it used to write through], [names the forced writer tries first])."""
    from nagmoe.analysis import figures
    from nagmoe.checkpoint.consolidate import consolidate_run
    from nagmoe.rundir.lease import RunDirLease
    from nagmoe.rundir.info import prepare_run_dir, read_saved_config, write_run_info, write_summary
    from nagmoe.checkpoint.torch_layout import save_checkpoint
    from nagmoe.rundir.metrics import truncate_metrics

    def lease(run_dir):
        RunDirLease(run_dir, take_over=True).acquire().release()

    def figure(run_dir):
        figures.loss_curves({"g": [([1, 2], [1, 2], [3.0, 2.0])]}, {"g": "#000000"},
                            os.path.join(run_dir, "loss_curves.png"))

    pid = os.getpid()
    forced = f".tmp-{PLANTED}"
    return {
        "config.yaml": (lambda d: prepare_run_dir(d, read_saved_config(d), resuming=True),
                        ["config.yaml.tmp"], [f".config.yaml{forced}"]),
        "run_info.json": (lambda d: write_run_info(d, {}, "cpu"), ["run_info.json.tmp"], [f".run_info.json{forced}"]),
        "summary.json": (lambda d: write_summary(d, {"steps": 2}), ["summary.json.tmp"], [f".summary.json{forced}"]),
        "lease.json": (lease, [f"lease.json.tmp-{pid}"], [f".lease.json{forced}"]),
        "metrics.jsonl": (lambda d: truncate_metrics(os.path.join(d, "metrics.jsonl"), 1),
                          [f"metrics.jsonl.tmp-{pid}"], [f".metrics.jsonl{forced}"]),
        "figure": (figure, ["loss_curves.png"], [f".loss_curves.png{forced}"]),
        "consolidated.pt": (consolidate_run, [f"consolidated.pt.tmp-{pid}"], [f".consolidated.pt{forced}"]),
        "checkpoint": (lambda d: save_checkpoint(d, 4, torch.nn.Linear(2, 2), extra_state={"x": 1}),
                       [f"checkpoints/step_000004.tmp-{pid}"], [f"checkpoints/step_000004{forced}"]),
    }


@pytest.mark.parametrize("writer", ["config.yaml", "run_info.json", "summary.json", "lease.json", "metrics.jsonl",
                                    "figure", "consolidated.pt", "checkpoint"])
def test_the_writer_forced_onto_a_planted_name_does_not_follow_it(writer, victim, the_run, micro_args, tmp_path,
                                                                  monkeypatch):
    run_dir = copy_run(the_run, tmp_path)
    write, old_names, forced_names = _writers(the_run, micro_args)[writer]
    for name in old_names + forced_names:
        plant(os.path.join(run_dir, name), victim, "symlink")
    real, calls = secrets.token_hex, itertools.count()
    # every other draw is the planted name: each write's first try meets the plant, its second is fresh
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: PLANTED if next(calls) % 2 == 0 else real(n))
    try:
        write(run_dir)
    finally:
        monkeypatch.setattr(secrets, "token_hex", real)
        assert_untouched(victim)
    assert next(calls) >= 2, "the writer never drew a fresh temporary name (the forcing did not happen)"
    for name in forced_names:  # the planted link is left as it was: neither followed nor taken as ours
        assert os.readlink(os.path.join(run_dir, name)) == victim


def test_a_writer_that_only_meets_planted_names_fails_cleanly(victim, tmp_path, monkeypatch):
    from nagmoe.rundir.info import write_summary

    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        f.write('{"steps": 1}')
    plant(os.path.join(run_dir, f".summary.json.tmp-{PLANTED}"), victim, "symlink")
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: PLANTED)
    with pytest.raises(UserError, match="cannot create a fresh temporary file there"):
        write_summary(run_dir, {"steps": 2})
    assert_untouched(victim)
    assert json.load(open(os.path.join(run_dir, "summary.json"))) == {"steps": 1}  # nothing written is lost


# ----------------------------------------------------------------------------------------------------------
# (c) one writer: no other file write in nagmoe/
# ----------------------------------------------------------------------------------------------------------
# (file, what) -> why it may stay. User-named `--out` files go through the writer too, so nothing is listed today.
ALLOWED: dict = {}
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"}


def _is_devnull(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "devnull"


def _mode_of(call: ast.Call, position: int):
    for kw in call.keywords:
        if kw.arg == "mode":
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _writes_mode(mode) -> bool:
    """A write mode, or one the scan cannot read (a variable): both need the writer."""
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _file_objects(scope) -> set:
    """Names bound by `with ... as NAME` in `scope`: file objects (the writer's, an open descriptor's)."""
    return {item.optional_vars.id for node in ast.walk(scope) if isinstance(node, (ast.With, ast.AsyncWith))
            for item in node.items if isinstance(item.optional_vars, ast.Name)}


def unsafe_writes(source: str) -> list:
    """(line, what) of every file write in `source` that does not go through nagmoe/base/files.py."""
    tree = ast.parse(source)
    found = []
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    scope_of = {}
    for scope in scopes:  # outer scopes first (ast.walk is breadth-first): the innermost function wins
        for node in ast.walk(scope):
            scope_of[id(node)] = scope
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, args = _dotted(node.func), node.args
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else name
        if name in ("open", "io.open", "builtins.open", "codecs.open", "gzip.open", "bz2.open", "lzma.open"):
            if _writes_mode(_mode_of(node, 1)) and not (args and _is_devnull(args[0])):
                found.append((node.lineno, f"{name}(..., mode) for writing"))
        elif attr == "open" and name != "os.open":  # Path.open("w"): a mode given as a keyword or a string
            mode = _mode_of(node, len(args))
            mode = mode if mode is not None else args[0] if args and isinstance(args[0], ast.Constant) else None
            if _writes_mode(mode):
                found.append((node.lineno, f"{name}(mode) for writing"))
        elif name == "os.open":
            flags = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
                     for a in args[1:2] for n in ast.walk(a)}
            if flags & WRITE_FLAGS and not (args and _is_devnull(args[0])):
                found.append((node.lineno, "os.open(path, write flags)"))
        elif attr == "savefig":
            if not any(kw.arg == "format" for kw in node.keywords):  # a file object needs format=: a path
                found.append((node.lineno, "savefig(path)"))
        elif name in ("torch.save", "np.save", "numpy.save", "np.savez", "np.savez_compressed", "np.savetxt") \
                or attr == "tofile":
            target = (args[1] if len(args) > 1 else next((k.value for k in node.keywords if k.arg == "f"), None)) \
                if name == "torch.save" else (args[0] if args else None)
            if not (isinstance(target, ast.Name) and target.id in _file_objects(scope_of[id(node)])):
                found.append((node.lineno, f"{name}(<path>)"))
        elif attr == "memmap" and _writes_mode(_mode_of(node, 2)):
            found.append((node.lineno, "np.memmap(path, mode) for writing"))
        elif attr in ("chmod", "lchmod", "write_text", "write_bytes") or name in (
                "shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree"):
            found.append((node.lineno, f"{name}()"))
    return sorted(found)


def test_the_scan_finds_each_kind_of_write():
    """The scan itself, on the writes c9620be had (a scan that finds nothing proves nothing)."""
    source = """
import os, torch, numpy as np
def f(path, fig, obj, a):
    with open(path + ".tmp", "w") as g:
        g.write("x")
    open(path, "a").write("x")
    open(path, mode="wb")
    fig.savefig(path, dpi=110)
    torch.save(obj, path)
    np.save(path, a)
    os.chmod(path, 0o755)
    os.open(path, os.O_WRONLY | os.O_CREAT)
    np.memmap(path, dtype="uint16", mode="w+", shape=(3,))
def g(path, fig, obj):
    with open(path) as r, open(os.devnull, "w") as null:
        pass
    with atomic_writer(path, binary=True) as f:
        torch.save(obj, f)
        fig.savefig(f, format="png")
"""
    assert [line for line, _ in unsafe_writes(source)] == [4, 6, 7, 8, 9, 10, 11, 12, 13]


def test_no_module_writes_a_file_outside_the_safe_writer():
    found = []
    for folder, _, files in os.walk(os.path.join(REPO, "nagmoe")):
        for name in sorted(files):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, REPO)
            if not name.endswith(".py") or rel == os.path.join("nagmoe", "base", "files.py"):
                continue
            with open(path) as f:
                found += [f"{rel}:{line}: {what}" for line, what in unsafe_writes(f.read())
                          if (rel, what) not in ALLOWED]
    assert not found, "writes outside nagmoe/base/files.py:\n" + "\n".join(found)


# ----------------------------------------------------------------------------------------------------------
# (d) permissions under the umask, and directories that are symlinks
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_files_written_under_umask_027_are_0640_and_directories_0750(umask_027, the_run, tmp_path, capsys):
    """The run (started and resumed under umask 027), its consolidation and its report: 0640 files, a 0750 save."""
    run_dir, out = copy_run(the_run, tmp_path), str(tmp_path / "report")
    for argv in (["consolidate", run_dir], ["report", run_dir, "--out", out, "--eval-items", "2",
                                            "--analysis-tokens", "0", "--device", "cpu"]):
        code, err = run_cli(capsys, argv)
        assert code == 0, err[-3000:]
    run, step = the_run["run_dir"], os.path.join(the_run["run_dir"], "checkpoints", "step_000003")
    files = [os.path.join(run, n) for n in ("config.yaml", "run_info.json", "summary.json", "metrics.jsonl")]
    files += [os.path.join(step, n) for n in ("state.json", "manifest.json")]
    files += [os.path.join(run_dir, "consolidated.pt")]
    files += [os.path.join(out, n) for n in ("report.html", "report.json", "data/run.json", "figures/loss_curves.png")]
    modes = {p: oct(stat.S_IMODE(os.stat(p).st_mode)) for p in files}
    assert set(modes.values()) == {"0o640"}, modes
    assert oct(stat.S_IMODE(os.stat(step).st_mode)) == "0o750"  # the published save's directory: the group reads it
    assert not [n for n in os.listdir(step) if stat.S_IMODE(os.stat(os.path.join(step, n)).st_mode) != 0o640]


def test_a_run_dir_and_checkpoints_that_are_symlinks_still_train_save_and_resume(the_run):
    scratch, run_dir = the_run["scratch"], the_run["run_dir"]
    assert the_run["start"] == 0 and the_run["resume"] == 0
    assert os.path.islink(run_dir) and os.path.islink(os.path.join(run_dir, "checkpoints"))
    saves = [n for n in os.listdir(os.path.join(scratch, "ckpts")) if n not in the_run["planted"]]
    assert saves == ["step_000003"]  # saved into the linked folder, the older one pruned there
    info = json.load(open(os.path.join(scratch, "run", "run_info.json")))
    assert info["resumed_from"].endswith("step_000002")
