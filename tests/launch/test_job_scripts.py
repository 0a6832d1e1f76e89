"""Rendered job scripts take data, never code (issue 40): every sbatch template (training, preflight, the three
data-preparation jobs, an experiment's training and report jobs) rendered with hostile values in every user field
either carries the value literally or is refused with one line (UserError, exit 2); the environment numbers the
scripts do arithmetic with are checked first; the files they write do not follow planted links.

A rendered script is checked the way its two readers read it: bash (no command before the #SBATCH block ends,
`bash -n`, and the whole script run with stand-ins for srun/scontrol/torchrun/python that record their argv and
working directory) and sbatch (its #SBATCH parser, `sbatch_words`, after Slurm 22.05's get_argument: quotes group,
`\\` escapes, `#` starts a comment, whitespace separates). One test submits the scripts to the real one-machine
Slurm of tests/slurm and reads the log paths and working directories Slurm really used."""
import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

from nagmoe.base.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = sys.executable  # the stubs fixture renders with a stand-in in its place
from slurm_cluster import running_cluster, wait_until  # noqa: E402

MARK = "M"  # every payload tries to create a file of this name
PAYLOADS = {
    "subst": "$(touch M)", "subst_ifs": "$(touch${IFS}M)", "backtick": "`touch M`", "squote": "'",
    "dquote": '"', "semicolon": ";touch M;", "hash": "#x", "newline": "\ntouch M\n", "cr": "\rtouch M",
    "percent": "%j", "backslash": "\\",
}
REFUSED_IN_PATHS = {"newline", "cr", "backslash"}  # cannot be carried by a #SBATCH line (decisions.md)
SPACE = " \t\n\v\f\r"  # C isspace


# ----------------------------------------------------------------------------------------------------------
# sbatch's and bash's view of a script
# ----------------------------------------------------------------------------------------------------------
def sbatch_words(text):
    """The arguments sbatch reads from the rest of one #SBATCH line (Slurm 22.05 src/sbatch/opt.c get_argument)."""
    words, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in SPACE:
            i += 1
        if i >= n:
            return words
        if text[i] == ":":
            raise ValueError(f"sbatch: Unexpected `:` in {text!r}")
        arg, quoted, q_char, escaped, comment = [], False, "", False, False
        while i < n and (quoted or text[i] not in SPACE):
            c = text[i]
            if escaped:
                escaped = False
            elif c == "\\":
                escaped, i = True, i + 1
                continue
            elif quoted:
                if c == q_char:
                    quoted, i = False, i + 1
                    continue
            elif c in "\"'":
                quoted, q_char, i = True, c, i + 1
                continue
            elif c == "#":
                comment = True
                break
            arg.append(c)
            i += 1
        if quoted:
            raise ValueError(f"sbatch: Unmatched `{q_char}` in {text!r}")
        if not arg:
            return words
        words.append("".join(arg))
        if comment:
            return words


def sbatch_directives(script):
    """sbatch's options from a script: #SBATCH lines until the first line that is not a comment."""
    args = []
    for line in script.split("\n"):
        if line.startswith("#SBATCH"):
            args += sbatch_words(line[len("#SBATCH"):])
        elif line.lstrip(SPACE)[:1] not in ("", "#"):
            break
    return args


def check_script(script, n_sbatch, tmp_path):
    """Bash's view: `#!`, then only #SBATCH lines, comments and blank lines before the first command (`set ...`),
    `n_sbatch` #SBATCH lines all in that header, `bash -n` clean. Returns sbatch's options {name: value}."""
    lines = script.split("\n")  # bash and sbatch end a line at \n only
    assert lines[0] == "#!/bin/bash"
    first = next(i for i, line in enumerate(lines) if line.strip(SPACE) and not line.lstrip(SPACE).startswith("#"))
    assert lines[first].startswith("set -"), lines[first]
    assert sum(line.startswith("#SBATCH") for line in lines[:first]) == n_sbatch
    assert sum(line.startswith("#SBATCH") for line in lines) == n_sbatch
    path = tmp_path / "syntax.sh"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    words = sbatch_directives(script)
    assert len(words) == n_sbatch, words  # one argument per line: nothing split off, nothing cut by a `#`
    return dict(w.split("=", 1) if "=" in w else (w, True) for w in words)


# ----------------------------------------------------------------------------------------------------------
# Stand-ins for the cluster's commands and the launchers: record cwd + argv, run nothing
# ----------------------------------------------------------------------------------------------------------
STUB = r"""#!/bin/bash
# a stand-in: records its working directory and argv (NUL-separated) in $STUB_DIR/rec/NAME.PID
name=${0##*/}
mkdir -p "$STUB_DIR/rec"
printf '%s\0' "$PWD" "$@" > "$STUB_DIR/rec/$name.$$"
case "$name ${1:-} ${2:-}" in
  "scontrol show hostnames") echo node1 ;;
  "getent hosts node1") echo "127.0.0.1 node1" ;;  # the rendezvous host resolves (train.sbatch checks it)
  sbatch*) echo 4242 ;;
esac
if [[ $name == srun && -n "${STUB_PREEMPT:-}" ]]; then  # a preemption during the training step
  req="$STUB_RUN_DIR/preempt.request"
  case "${STUB_PLANT:-}" in  # another user plants a link at the request file's name first
    symlink) ln -s "$STUB_VICTIM" "$req" ;;
    hardlink) ln "$STUB_VICTIM" "$req" ;;
  esac
  kill -USR1 "$PPID"  # Slurm's --signal=B:USR1 to the batch shell
  for _ in $(seq 250); do grep -qs '^USR1' "$req" && break; command sleep 0.02; done  # the trap's request
fi
exit 0
"""


@pytest.fixture
def stubs(tmp_path, monkeypatch):
    """A folder of stand-ins (srun, scontrol, sbatch, torchrun, python) first on PATH; the scripts are rendered
    with this `python` as sys.executable (so PYTHON and TORCHRUN in them are stand-ins too)."""
    folder = tmp_path / "stubs"
    folder.mkdir()
    for name in ("srun", "scontrol", "sbatch", "torchrun", "python", "getent"):
        (folder / name).write_text(STUB)
        (folder / name).chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(folder / "python"))
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STUB_DIR", str(folder))
    return folder


def records(stubs):
    """[(name, cwd, argv)] of every stand-in call so far; clears them."""
    out = []
    folder = stubs / "rec"
    for entry in sorted(os.listdir(folder)) if folder.is_dir() else []:
        with open(folder / entry, "rb") as f:
            cwd, *argv = f.read().decode().split("\0")[:-1]
        out.append((entry.split(".")[0], cwd, argv))
        os.remove(folder / entry)
    return out


def run_script(script, tmp_path, env=None, timeout=30):
    path = tmp_path / "job.sh"
    path.write_text(script)
    scratch = tmp_path / "cwd-of-bash"
    scratch.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "MASTER_", "NAGMOE_"))
            and k != "BASH_ENV"}
    env = {**base, "SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1", **(env or {})}
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, cwd=scratch,
                          timeout=timeout)


def no_marker_anywhere(root):
    found = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f == MARK]
    assert not found, f"a payload ran: {found}"


def arg_after(argv, flag):
    return argv[argv.index(flag) + 1]


# ----------------------------------------------------------------------------------------------------------
# Rendering every template
# ----------------------------------------------------------------------------------------------------------
def cpu_options(**kw):
    from nagmoe.launch.slurm import SlurmOptions

    return SlurmOptions(nodes=1, gpus_per_node=0, procs_per_node=1, time="10", **kw)


EXPERIMENT = f"name: exp\nflop_budget: 1.0e+15\nseeds: [0]\nruns: {{nag: {{config: {REPO}/configs/tiny.yaml}}}}\n"


def experiment(tmp_path, runs_root, description=""):
    from nagmoe.launch.experiment import load_experiment

    path = tmp_path / "exp.yaml"
    path.write_text(EXPERIMENT)
    exp = load_experiment(str(path))
    exp.description = description
    return exp, exp.plan(runs_root)


def render_all(tmp_path, opts, run_dir, runs_root):
    """[(name, script, log_dir, log_name)] for every template; UserError propagates."""
    from nagmoe.launch import experiment as ex
    from nagmoe.launch import slurm

    run_dir = os.path.abspath(run_dir)
    out = [("train", slurm.render_train_script(opts, run_dir), os.path.join(run_dir, "slurm"), "slurm-%j.out"),
           ("preflight", slurm.render_preflight_script(opts, run_dir), os.path.join(run_dir, "preflight", "slurm"),
            "slurm-%j.out")]
    logs = {"tokenizer": "slurm-%j.out", "slices": "slurm-%A_%a.out", "merge": "slurm-%j.out"}
    for step, text in slurm.render_prepare_scripts(opts, run_dir, 2).items():
        out.append((f"prepare_{step}", text, os.path.join(run_dir, "slurm"), logs[step]))
    exp, plans = experiment(tmp_path, runs_root)
    exp_out = os.path.join(os.path.abspath(runs_root), "exp")
    jobs, report = ex.slurm_jobs(exp, plans, opts, runs_root)
    assert [j.label for j in jobs] == ["nag-s0"]
    out.append(("exp_train", jobs[0].script, os.path.join(exp_out, "nag-s0", "slurm"), "slurm-%j.out"))
    out.append(("exp_report", report.script, os.path.join(exp_out, "slurm"), "slurm-report-%j.out"))
    _, report_only = ex.slurm_jobs(exp, [], opts, runs_root)  # every run finished: the report job alone
    out.append(("exp_report_alone", report_only.script, os.path.join(exp_out, "slurm"), "slurm-report-%j.out"))
    return out


# CPU mode, --time 10: job name, nodes, tasks, cpus, time, output, open mode, chdir (+ requeue and signal for
# training, array for the slices, kill-on-invalid-dep for data preparation)
N_SBATCH = {"train": 10, "preflight": 8, "prepare_tokenizer": 9, "prepare_slices": 10, "prepare_merge": 9,
            "exp_train": 10, "exp_report": 8, "exp_report_alone": 8}


def hostile_dir(base, payload):
    return os.path.join(str(base), f"a{payload}b")


class Pinned:
    """The pinned config of a run dir (issue 41): RUN_DIR/slurm/config-<sha12>.yaml, the path taken literally."""

    def __init__(self, run_dir):
        self.folder = os.path.join(run_dir, "slurm")

    def __eq__(self, other):
        return (isinstance(other, str) and os.path.dirname(other) == self.folder
                and re.fullmatch(r"config-[0-9a-f]{12}\.yaml", os.path.basename(other)) is not None)

    def __repr__(self):
        return f"Pinned({self.folder!r})"


def expected_argv(name, run_dir, runs_root, description):
    """What the launcher stand-in must receive, literally, from each script."""
    run_dir, exp_out = os.path.abspath(run_dir), os.path.join(os.path.abspath(runs_root), "exp")
    if name == "train":
        # plain progress lines in the job log (issue 67 item 7)
        return "srun", {"--run-dir": run_dir, "--config": os.path.join(run_dir, "slurm", "config.yaml"),
                        "--progress": "lines"}
    if name == "exp_train":
        run = os.path.join(exp_out, "nag-s0")
        return "srun", {"--run-dir": run, "--config": Pinned(run), "--progress": "lines"}
    if name == "preflight":
        return "srun", {"--dir": os.path.join(run_dir, "preflight")}
    if name.startswith("prepare_"):
        return "python", {"--config": os.path.join(run_dir, "slurm", "config.yaml")}
    return "python", {"--out": exp_out, **({"--description": description} if description else {}),
                      "report": os.path.join(exp_out, "nag-s0")}


def check_rendered(rendered, tmp_path, stubs, run_dir, runs_root, cwd, description=""):
    for name, script, log_dir, log_name in rendered:
        options = check_script(script, N_SBATCH[name], tmp_path)
        assert options["--output"] == log_dir.replace("%", "%%") + "/" + log_name, name  # % literal, ours expanded
        assert options["--chdir"] == cwd, name
        ran = run_script(script, tmp_path)
        assert ran.returncode == 0, (name, ran.stdout, ran.stderr)
        launcher, want = expected_argv(name, run_dir, runs_root, description)
        calls = [argv for stub, _, argv in records(stubs) if stub == launcher]
        assert len(calls) == 1, (name, calls)
        for flag, value in want.items():
            assert arg_after(calls[0], flag) == value, (name, flag)
    no_marker_anywhere(tmp_path)


# ----------------------------------------------------------------------------------------------------------
# Hostile values in every field
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("payload", list(PAYLOADS))
@pytest.mark.parametrize("field", ["run_dir", "runs_root", "cwd"])
def test_paths_are_rendered_literally_or_refused(field, payload, tmp_path, stubs, monkeypatch):
    """Run dir, runs root (the experiment's run dirs and its report job, also when it is the only job) and the
    working directory (--chdir): the path reaches sbatch and the launcher byte for byte, or exit 2."""
    value = PAYLOADS[payload]
    run_dir, runs_root, cwd = tmp_path / "runs" / "r", tmp_path / "root", tmp_path / "cwd"
    if field == "run_dir":
        run_dir = hostile_dir(tmp_path / "runs", value)
    elif field == "runs_root":
        runs_root = hostile_dir(tmp_path, value)
    else:
        cwd = hostile_dir(tmp_path, value)
    os.makedirs(cwd)
    monkeypatch.chdir(cwd)
    try:
        rendered = render_all(tmp_path, cpu_options().validate(), run_dir, runs_root)
    except UserError as e:
        assert payload in REFUSED_IN_PATHS, f"refused: {e}"
        assert "\n" not in str(e) and len(str(e)) < 400, str(e)
        what = {"run_dir": "--run-dir", "runs_root": "--runs-root", "cwd": "working directory"}[field]
        assert str(e).startswith(what), str(e)
        return
    assert payload not in REFUSED_IN_PATHS
    check_rendered(rendered, tmp_path, stubs, run_dir, runs_root, str(cwd))


def test_a_newline_in_the_runs_root_is_refused_for_the_report_job_alone(tmp_path, monkeypatch):
    """Every run finished: only the report job is rendered, and its --output path is checked like the others."""
    from nagmoe.launch import experiment as ex

    monkeypatch.chdir(tmp_path)
    root = hostile_dir(tmp_path, "\n#SBATCH --x\ntouch M\n")
    exp, _ = experiment(tmp_path, root)
    with pytest.raises(UserError, match=r"^--runs-root: .*control character"):
        ex.slurm_jobs(exp, [], cpu_options().validate(), root)


PLAIN_WORDS = {"job_name": "my.job-1", "partition": "gpu,debug", "account": "lab_1", "time": "2-00:00:00"}


@pytest.mark.parametrize("payload", ["plain", *PAYLOADS])
@pytest.mark.parametrize("field", list(PLAIN_WORDS))
def test_one_word_options_take_a_safe_alphabet(field, payload, tmp_path, stubs, monkeypatch):
    """Job name, partition, account, time: one word of [A-Za-z0-9_.+,:=@-] (no quoting needed in a #SBATCH
    line), every payload refused with one line; a plain value rendered as given."""
    monkeypatch.chdir(tmp_path)
    value = PLAIN_WORDS[field] if payload == "plain" else f"a{PAYLOADS[payload]}b"
    kw = {"time": value} if field == "time" else {field: value}
    from nagmoe.launch.slurm import SlurmOptions

    opts = SlurmOptions(nodes=1, gpus_per_node=0, procs_per_node=1, **{"time": "10", **kw})
    if payload != "plain":
        with pytest.raises(UserError) as info:
            opts.validate()
        assert str(info.value).startswith(f"--{field.replace('_', '-')}: ") and "\n" not in str(info.value)
        return
    for name, script, *_ in render_all(tmp_path, opts.validate(), tmp_path / "run", tmp_path / "root"):
        n = N_SBATCH[name] + (field in ("partition", "account"))
        options = check_script(script, n, tmp_path)
        want = value if field != "job_name" else options["--job-name"]
        assert options[f"--{field.replace('_', '-')}"] == want
        if field == "job_name":
            assert want.startswith(value)


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_sbatch_args_are_one_line_each_or_refused(payload, tmp_path, stubs, monkeypatch):
    """--sbatch-arg is an sbatch option, verbatim, on one #SBATCH line: a control character (a newline would
    render a shell line, and sbatch would ignore every later directive) is refused with one line."""
    monkeypatch.chdir(tmp_path)
    arg = f"--comment={PAYLOADS[payload]}"
    opts = cpu_options(sbatch_args=["--exclusive", arg, "--mem=1G"])
    if payload in ("newline", "cr"):
        with pytest.raises(UserError, match=r"^--sbatch-arg: .*control character"):
            opts.validate()
        return
    for name, script, *_ in render_all(tmp_path, opts.validate(), tmp_path / "run", tmp_path / "root"):
        lines = script.split("\n")
        first = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
        assert lines[first].startswith("set -")
        directives = [line for line in lines[:first] if line.startswith("#SBATCH")]
        assert directives[-3:] == ["#SBATCH --exclusive", f"#SBATCH {arg}", "#SBATCH --mem=1G"]  # in order, verbatim
        assert sum(line.startswith("#SBATCH") for line in lines) == len(directives) == N_SBATCH[name] + 3
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
        ran = run_script(script, tmp_path)
        assert ran.returncode == 0, ran.stderr
    no_marker_anywhere(tmp_path)


@pytest.mark.parametrize("value", ["\t", "\x0b", "\x0c", "\x00", "\x1b[2J", "\x85", "\u2028"])
def test_sbatch_arg_with_any_control_character_is_refused(value):
    with pytest.raises(UserError, match=r"^--sbatch-arg: .*control character"):
        cpu_options(sbatch_args=[f"--comment=a{value}b"]).validate()
    with pytest.raises(UserError, match=r"^--sbatch-arg: .*not an sbatch option"):
        cpu_options(sbatch_args=["touch M"]).validate()


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_the_report_job_carries_description_and_runs_root_literally(payload, tmp_path, stubs, monkeypatch):
    """The report job: the experiment's description (any payload, newlines included: it is quoted in the command,
    after the #SBATCH block) and a runs root with `$(...)` and a quote reach `nagmoe report` as they are; before,
    the runs root was shlex.quote'd inside double quotes (`echo "... -> '...'"`), where `$(...)` runs."""
    from nagmoe.launch import experiment as ex

    monkeypatch.chdir(tmp_path)
    description = f"one {PAYLOADS[payload]} line"
    root = tmp_path / "root$(touch${IFS}M)'"
    exp, plans = experiment(tmp_path, root, description)
    _, report = ex.slurm_jobs(exp, plans, cpu_options().validate(), root)
    check_rendered([("exp_report", report.script, str(root / "exp" / "slurm"), "slurm-report-%j.out")],
                   tmp_path, stubs, tmp_path / "r", root, str(tmp_path), description)


@pytest.mark.parametrize("key", ["name", "run"])
def test_experiment_and_run_names_with_a_trailing_newline_are_refused(key, tmp_path):
    """`^...$` matched "demo\\n": the name reached the report script's header comment as a second line."""
    from nagmoe.launch.experiment import load_experiment

    name, run = ("demo\\n", "nag") if key == "name" else ("demo", "nag\\n")
    path = tmp_path / "exp.yaml"
    path.write_text(f'name: "{name}"\nflop_budget: 1.0e+15\nseeds: [0]\n'
                    f'runs: {{"{run}": {{config: {REPO}/configs/tiny.yaml}}}}\n')
    with pytest.raises(UserError, match="must be one word"):
        load_experiment(str(path))


def test_cli_renders_hostile_paths_literally_and_refuses_control_characters(tmp_path):
    """Through `nagmoe launch slurm` and `nagmoe experiment`: exit 0 with the literal path, exit 2 with one line
    and no traceback; an invalid NAGMOE_REQUEUE_POLL_S is warned about at render time."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))},
           "OMP_NUM_THREADS": "1", "NAGMOE_REQUEUE_POLL_S": "1.5"}
    cwd = tmp_path / "work $(touch M) 'q' \"d\" %j #c"
    cwd.mkdir()
    run_dir = str(tmp_path / "r $(touch${IFS}M) `touch M`;'\"%j#")

    def nagmoe(*args):
        return subprocess.run([sys.executable, "-m", "nagmoe", *args], capture_output=True, text=True, env=env,
                              cwd=cwd, timeout=120)

    ok = nagmoe("launch", "slurm", "--config", f"{REPO}/configs/tiny.yaml", "--gpus-per-node", "0",
                "--run-dir", run_dir, "--dry-run")
    assert ok.returncode == 0, ok.stderr
    options = check_script(ok.stdout, 9, tmp_path)  # no --time
    assert options["--output"] == run_dir.replace("%", "%%") + "/slurm/slurm-%j.out"
    assert options["--chdir"] == str(cwd)
    assert "NAGMOE_REQUEUE_POLL_S='1.5' is not a whole number of seconds" in ok.stderr
    bad = nagmoe("launch", "slurm", "--config", f"{REPO}/configs/tiny.yaml", "--run-dir", str(tmp_path / "r"),
                 "--sbatch-arg=--exclusive", "--sbatch-arg=--comment=x\ntouch M", "--dry-run")
    errors = [line for line in bad.stderr.splitlines() if ": error: " in line]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(errors) == 1, bad.stderr
    assert "--sbatch-arg: " in errors[0] and "control character" in errors[0] and not bad.stdout
    exp = tmp_path / "exp.yaml"
    exp.write_text(EXPERIMENT)
    bad = nagmoe("experiment", str(exp), "--slurm", "--dry-run", "--gpus-per-node", "0",
                 "--runs-root", str(tmp_path / "root\ntouch M"))
    errors = [line for line in bad.stderr.splitlines() if ": error: " in line]
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(errors) == 1, bad.stderr
    assert "--runs-root: " in errors[0] and "control character" in errors[0]
    no_marker_anywhere(tmp_path)


# ----------------------------------------------------------------------------------------------------------
# Environment numbers: NAGMOE_REQUEUE_POLL_S in the preempted job, GPU_CHECK_* in tools/gpu_check/gpu_check.sh
# ----------------------------------------------------------------------------------------------------------
FAST_CLOCK = """# sourced by bash before the script (BASH_ENV): `sleep N` advances bash's clock by N seconds at once
sleep() { SECONDS=$((SECONDS + ${1%%.*})); echo "$1" >> "$SLEEP_LOG"; }
"""


def preempted_job(tmp_path, stubs, monkeypatch, env):
    """The rendered training script run under bash with stand-ins: the training step (srun) gets the batch
    shell a USR1, as Slurm's --signal=B:USR1 would; the script's own trap and requeue block do the rest. Its sleeps
    take no time (FAST_CLOCK). Returns (the run, run dir, scontrol's calls, the seconds it waited)."""
    from nagmoe.launch import slurm

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    script = slurm.render_train_script(cpu_options().validate(), str(run_dir))
    (tmp_path / "clock.sh").write_text(FAST_CLOCK)
    ran = run_script(script, tmp_path, env={"STUB_PREEMPT": "1", "STUB_RUN_DIR": str(run_dir),
                                            "BASH_ENV": str(tmp_path / "clock.sh"),
                                            "SLEEP_LOG": str(tmp_path / "sleeps"), **env})
    calls = [argv for stub, _, argv in records(stubs) if stub == "scontrol" and argv[:1] not in (["show"], ["listpids"])]
    sleeps = (tmp_path / "sleeps").read_text().split() if (tmp_path / "sleeps").exists() else []
    return ran, run_dir, calls, sum(int(s) for s in sleeps)


@pytest.mark.parametrize("value, waits", [
    ("1.5", 60), ("2m", 60), ("x[$(touch M)]", 60), ("SECONDS[$(touch${IFS}M)]", 60), ("-1", 60), ("9\n", 60),
    ("08", 8), ("", 60), (None, 60)])
def test_an_invalid_requeue_poll_warns_waits_60_s_and_still_requeues(value, waits, tmp_path, stubs, monkeypatch):
    """A bad NAGMOE_REQUEUE_POLL_S (from the submitting shell: sbatch --export=ALL) inside a preempted job: a
    warning, the default 60 s, and the job is requeued; before, bash arithmetic aborted the block (the job lost)
    or ran the command inside it. `08` is eight seconds, not an octal error."""
    ran, _, calls, waited = preempted_job(tmp_path, stubs, monkeypatch,
                                          {} if value is None else {"NAGMOE_REQUEUE_POLL_S": value})
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert calls == [["requeue", "7"]], ran.stdout + ran.stderr
    assert "preempted: requeueing job 7" in ran.stdout
    warned = [line for line in ran.stdout.splitlines() if "WARNING: NAGMOE_REQUEUE_POLL_S=" in line]
    assert len(warned) == (waits == 60 and bool(value)), ran.stdout
    assert waited == waits
    no_marker_anywhere(tmp_path)


def test_the_render_time_check_names_the_same_values():
    from nagmoe.launch.slurm import POLL_ENV, requeue_poll_problem

    for good in ("0", "60", "08", "999999", ""):
        assert requeue_poll_problem({POLL_ENV: good}) is None
    for bad in ("1.5", "2m", "x[$(touch M)]", "-1", "9\n", "1234567", "٣"):
        problem = requeue_poll_problem({POLL_ENV: bad})
        assert problem.startswith("[nagmoe] WARNING: NAGMOE_REQUEUE_POLL_S=") and "\n" not in problem


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_the_trap_writes_the_request_through_a_fresh_temporary(kind, tmp_path, stubs, monkeypatch):
    """A link planted at RUN_DIR/preempt.request while the job runs: the trap's request replaces it (mktemp +
    mv -f -T) and the other file is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    victim.chmod(0o644)
    ran, run_dir, calls, _ = preempted_job(tmp_path, stubs, monkeypatch, {
        "NAGMOE_REQUEUE_POLL_S": "0", "STUB_PLANT": kind, "STUB_VICTIM": str(victim)})
    assert ran.returncode == 0 and calls == [["requeue", "7"]], ran.stdout + ran.stderr
    assert victim.read_text() == "someone else's file\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    request = run_dir / "preempt.request"
    assert not request.is_symlink() and request.stat().st_nlink == 1 and request.read_text().startswith("USR1 ")
    assert [p.name for p in run_dir.iterdir() if ".tmp" in p.name] == []  # no temporary left


def gpu_check(out, **env):
    """tools/gpu_check/gpu_check.sh --cpu with only its `data` section, which fails at its start (GPU_CHECK_FAIL):
    fast."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(out), "GPU_CHECK_SECTIONS": "data",
           "GPU_CHECK_FAIL": "data", **env}
    return subprocess.run(["bash", os.path.join(REPO, "tools/gpu_check/gpu_check.sh"), "--cpu"], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("env", [
    {"GPU_CHECK_BUDGET": "1.5"}, {"GPU_CHECK_BUDGET": "a[$(touch${IFS}{M})]"}, {"GPU_CHECK_BUDGET": "2m"},
    {"GPU_CHECK_LIMIT_data": "SECONDS[$(touch${IFS}{M})]"}, {"GPU_CHECK_LIMIT_dcp": "x"}])
def test_gpu_check_refuses_a_bad_number_before_running_anything(env, tmp_path):
    """tools/gpu_check/gpu_check.sh: a budget or section limit that is not whole seconds stops it at once, one line,
    exit 2, nothing run (decisions.md: exit rather than a default, a check must run under the limits asked)."""
    marker = tmp_path / MARK
    env = {k: v.replace("{M}", str(marker)) for k, v in env.items()}
    out = tmp_path / "out"
    done = gpu_check(out, **env)
    assert done.returncode == 2, done.stdout + done.stderr
    name = next(iter(env))
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"tools/gpu_check/gpu_check.sh: {name}=")
    assert "must be a whole number of seconds" in done.stderr
    assert not marker.exists() and not (out / "bench.json").exists()


def test_gpu_check_reads_leading_zeros_as_decimal(tmp_path):
    out = tmp_path / "out"
    done = gpu_check(out, GPU_CHECK_BUDGET="090", GPU_CHECK_LIMIT_data="08")
    assert done.returncode == 1, done.stdout + done.stderr  # the section fails on purpose; the budget is read
    bench = json.loads((out / "bench.json").read_text())
    assert bench["budget"] == 90 and bench["sections"]["data"]["limit"] == 8


# ----------------------------------------------------------------------------------------------------------
# Files the launch writes: no planted link is followed
# ----------------------------------------------------------------------------------------------------------
def plant(kind, victim, *paths):
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        (os.symlink if kind == "symlink" else os.link)(victim, path)


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_text("someone else's file\n")
    path.chmod(0o600)
    yield path
    assert path.read_text() == "someone else's file\n" and stat.S_IMODE(path.stat().st_mode) == 0o600


def assert_ours(path, text):
    assert not os.path.islink(path) and os.stat(path).st_nlink == 1
    with open(path) as f:
        assert f.read() == text


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_slurm_files_replace_planted_links_and_keep_the_umask(kind, victim, tmp_path):
    """RUN_DIR/slurm/{config.yaml,train.sbatch}: links planted at the final names and at the old `.tmp` names;
    under umask 027 the script is 0750 and the config 0640 (no chmod of a path, no 0600 temporary)."""
    from nagmoe.launch.slurm import write_files

    folder = tmp_path / "run" / "slurm"
    plant(kind, victim, *(str(folder / n) for n in ("config.yaml", "config.yaml.tmp", "train.sbatch",
                                                    "train.sbatch.tmp")))
    old = os.umask(0o027)
    try:
        paths = write_files(str(tmp_path / "run"), "model: {}\n", {"train.sbatch": "#!/bin/bash\ntrue\n"})
    finally:
        os.umask(old)
    assert_ours(paths["config.yaml"], "model: {}\n")
    assert_ours(paths["train.sbatch"], "#!/bin/bash\ntrue\n")
    assert stat.S_IMODE(os.stat(paths["train.sbatch"]).st_mode) == 0o750
    assert stat.S_IMODE(os.stat(paths["config.yaml"]).st_mode) == 0o640


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_the_experiment_report_script_replaces_a_planted_link(kind, victim, tmp_path, stubs, monkeypatch):
    from nagmoe.launch import experiment as ex

    monkeypatch.chdir(tmp_path)
    exp, _ = experiment(tmp_path, tmp_path / "root")
    _, report = ex.slurm_jobs(exp, [], cpu_options().validate(), tmp_path / "root")
    plant(kind, victim, report.path, report.path + ".tmp")
    assert ex.submit_slurm([], report, log=lambda line: None) == "4242"  # the sbatch stand-in's job id
    assert_ours(report.path, report.script)


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_the_stop_request_and_the_marker_replace_planted_links(kind, victim, tmp_path):
    from nagmoe.train.preemption import MARKER_FILE, REQUEST_FILE, Preempted, PreemptionWatch, request_stop

    run = tmp_path / "run"
    plant(kind, victim, *(str(run / n) for n in (REQUEST_FILE, REQUEST_FILE + ".tmp", MARKER_FILE,
                                                 MARKER_FILE + ".tmp")))
    request_stop(str(run), "test")
    assert not (run / REQUEST_FILE).is_symlink() and (run / REQUEST_FILE).read_text().startswith("test ")
    with pytest.raises(Preempted):
        PreemptionWatch(str(run)).stop(lambda: "step_000003", 3)
    marker = json.loads((run / MARKER_FILE).read_text())
    assert marker["step"] == 3 and not (run / MARKER_FILE).is_symlink() and (run / MARKER_FILE).stat().st_nlink == 1
    assert not (run / REQUEST_FILE).exists()  # consumed with the marker


# ----------------------------------------------------------------------------------------------------------
# The real thing: a one-machine Slurm (tests/support/slurm_cluster.py)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.slurm
def test_real_slurm_uses_the_hostile_paths_literally(tmp_path, stubs, monkeypatch):
    """Every template rendered with a run dir, runs root and working directory full of shell syntax, quotes, `#`,
    spaces and `%j`, submitted to a real sbatch and run by slurmd: each log lands at the literal path (our %j
    expanded, the path's own kept), each job runs in the literal working directory, the launcher stand-ins get
    the literal paths, and nothing runs."""
    hostile = "x $(touch M) `touch M`;'q' \"d\" %j #c"
    cwd = tmp_path / f"cwd {hostile}"
    cwd.mkdir()
    with monkeypatch.context() as m:
        m.chdir(cwd)
        rendered = render_all(tmp_path, cpu_options().validate(), tmp_path / f"run {hostile}",
                              tmp_path / f"root {hostile}")
    for _, _, log_dir, _ in rendered:
        os.makedirs(log_dir, exist_ok=True)  # Slurm does not create the log's folder
    job_path = os.environ["PATH"]  # the stand-ins first: the jobs' srun, scontrol and launchers
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in job_path.split(os.pathsep) if p != str(stubs)))
    monkeypatch.setattr(sys, "executable", PYTHON)
    with running_cluster(tmp_path / "slurm") as cluster:  # the daemons and our own clients: the real ones
        sbatch = shutil.which("sbatch", path=cluster.env["PATH"])
        assert not sbatch.startswith(str(stubs))
        jobs = {}
        for name, script, log_dir, log_name in rendered:
            path = tmp_path / f"{name}.sbatch"
            path.write_text(script)
            submitted = cluster.run(sbatch, "--parsable", str(path), env={"PATH": job_path})
            jobs[name] = submitted.stdout.strip().split(";")[0]
        wait_until(lambda: not cluster.run("squeue", "-h").stdout.strip(), 60, "every job to end")
        for name, script, log_dir, log_name in rendered:
            job = jobs[name]
            if "%a" in log_name:  # the array's tasks: slurm-<array job>_<index>.out
                logs = [log_name.replace("%A", job).replace("%a", str(i)) for i in (0, 1)]
            else:
                logs = [log_name.replace("%j", job)]
                assert cluster.job(job)["JobState"] == "COMPLETED", (name, cluster.job(job))
            for log in logs:  # at the literal path: Slurm expanded our %j and kept the path's own `%j`
                assert os.path.isfile(os.path.join(log_dir, log)), (name, log, os.listdir(log_dir))
    calls = records(stubs)
    launched = [(stub, cwd_, argv) for stub, cwd_, argv in calls if stub in ("srun", "python")]
    assert len(launched) == 9  # train, preflight, tokenizer, 2 slices, merge, experiment train, 2 reports
    assert {cwd_ for _, cwd_, _ in launched} == {str(cwd)}  # --chdir taken literally (Slurm expands no % there)
    for name, _, _, _ in rendered:
        launcher, want = expected_argv(name, tmp_path / f"run {hostile}", tmp_path / f"root {hostile}", "")
        assert any(stub == launcher and all(flag in argv and arg_after(argv, flag) == value
                                            for flag, value in want.items())
                   for stub, _, argv in launched), name
    no_marker_anywhere(tmp_path)
