"""Issue 41, build item 7, the reproductions of "Tracebacks instead of one line" and "Alias bombs and unbounded
messages" that concern configs, overrides, experiments, a CORE bundle's core.yaml and a run dir's saved
config.yaml: each is one line naming the file or key (exit 2), at most a few hundred characters of the value."""
import os
import subprocess
import sys

import pytest

from nagmoe.cli import main
from nagmoe.base.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
BOMB7 = ("a: &a ['lol','lol','lol','lol','lol','lol','lol','lol','lol']\n"
         + "".join(f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdef", "bcdefg")))
# the same bomb as one flow value (anchors defined left to right inside it): 446 bytes, 9**7 values expanded
BOMB7_FLOW = "[" + ", ".join(["&a0 [" + ", ".join(["lol"] * 9) + "]"]
                             + [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 7)]) + "]"


def one_line(capsys, args, *fragments, limit=1000):
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) <= limit, [line[:300] for line in err[:3]]
    for fragment in fragments:
        assert fragment in err[0], err[0]
    return err[0]


def write(tmp_path, name, text, mode="w"):
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


CONFIG_CASES = {  # a config file's text -> what the line names
    "alias bomb (7 levels) under a scalar key": (f"inherit: {TINY}\ntrain:\n  seed: {BOMB7_FLOW}\n",
                                                 "alias bomb"),
    "inherit: [1]": ("inherit: [1]\n", "inherit"),
    "inherit: 5": ("inherit: 5\n", "inherit"),
    "inherit: [null]": ("inherit: [null]\n", "inherit"),
    "inherit: a NUL byte": ('inherit: ["a\\0b"]\n', "not a usable path"),
    "5,000-deep nesting": ("train: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper"),
    "5,001-digit integer": (f"inherit: {TINY}\ntrain:\n  seed: {'9' * 5001}\n", "digits"),
    "train.seed: 1e23": (f"inherit: {TINY}\ntrain:\n  seed: 1e23\n", "train.seed"),
    "model.d_model: 2**40": (f"inherit: {TINY}\nmodel:\n  d_model: {2 ** 40}\n", "model.d_model"),
    "two model: blocks": (f"inherit: {TINY}\nmodel:\n  d_model: 64\nmodel:\n  n_layers: 2\n", "duplicate key 'model'"),
    "a list as train.compile": (f"inherit: {TINY}\ntrain:\n  compile: [{'x, ' * 50000}x]\n", "train.compile"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_bad_config_file_is_one_line(case, tmp_path, capsys):
    text, fragment = CONFIG_CASES[case]
    path = write(tmp_path, "c.yaml", text)
    one_line(capsys, ["config", "--config", path], fragment)


def test_a_config_that_is_not_utf8_is_one_line(tmp_path, capsys):
    path = write(tmp_path, "c.yaml", b"inherit: tiny.yaml\ndata:\n  corpus: caf\xe9\n")
    one_line(capsys, ["config", "--config", path], "not UTF-8")


def test_inherit_cycles_are_named_as_cycles_through_links(tmp_path, capsys):
    write(tmp_path, "a.yaml", "inherit: b.yaml\n")
    write(tmp_path, "b.yaml", "inherit: ./link.yaml\n")
    os.symlink(tmp_path / "a.yaml", tmp_path / "link.yaml")
    one_line(capsys, ["config", "--config", tmp_path / "a.yaml"], "inherit cycle")


@pytest.mark.parametrize("override,fragment", [
    ("train.seed=1e23", "train.seed"), (f"model.d_model={2 ** 40}", "model.d_model"),
    ("train.seed=" + "9" * 5001, "train.seed"), ("model.n_layers=" + "[" * 5000, "model.n_layers"),
    ("train.lr_matrix=1e400", "train.lr_matrix"), ("train.max_steps=" + "[1, " * 100000 + "1]", "train.max_steps"),
    ("train.seed=" + BOMB7_FLOW, "train.seed"),
])
def test_a_bad_override_is_one_line(override, fragment, capsys):
    one_line(capsys, ["config", "--config", TINY, override], fragment)


def experiment(tmp_path, body, name="exp.yaml"):
    return write(tmp_path, name, f"name: x\nflop_budget: 1e12\nruns:\n  nag:\n    config: {TINY}\n{body}")


@pytest.mark.parametrize("body,fragment", [
    ("seeds: " + BOMB7_FLOW, "alias bomb"), ("seeds: [0]\noverrides: [" + repr("train.seed=" + BOMB7_FLOW) + "]", "train.seed"),
    ("seeds: [1e23]", "seeds"), ("seeds: [" + "9" * 30 + "]", "seeds"),
    ("seeds: [0]\nseeds: [1]", "duplicate key 'seeds'"),
    ("seeds: [0]\noverrides: [1]", "overrides"),
])
def test_a_bad_experiment_field_is_one_line(body, fragment, tmp_path, capsys):
    path = experiment(tmp_path, body)
    one_line(capsys, ["experiment", path, "--slurm", "--dry-run", "--runs-root", tmp_path / "runs"], fragment)


def test_an_include_cycle_is_named_as_one(tmp_path, capsys):
    write(tmp_path, "a.yaml", "name: a\nseeds: [0]\ninclude: [b.yaml]\n")
    write(tmp_path, "b.yaml", "name: b\nseeds: [0]\ninclude: [a.yaml]\n")
    one_line(capsys, ["experiment", tmp_path / "a.yaml", "--slurm", "--dry-run", "--runs-root", tmp_path / "r"],
             "include cycle")


def test_a_core_yaml_with_duplicate_keys_is_refused(tmp_path):
    from nagmoe.eval.tasks import read_core_bundle

    (tmp_path / "eval_data").mkdir()
    write(tmp_path, "core.yaml", "icl_tasks: []\nicl_tasks: [{label: x}]\n")
    with pytest.raises(UserError, match="duplicate key 'icl_tasks'"):
        read_core_bundle(str(tmp_path))


@pytest.mark.parametrize("text", [b"model:\n  d_model: [", b"\xff\xfe", b"model: " + b"[" * 5000, BOMB7.encode()])
def test_a_torn_or_foreign_saved_config_is_one_line(text, tmp_path):
    from nagmoe.rundir.info import read_saved_config

    write(tmp_path, "config.yaml", text)
    with pytest.raises(UserError) as e:
        read_saved_config(str(tmp_path))
    assert "config.yaml" in str(e.value) and len(str(e.value)) <= 1000


def test_from_the_command_line_no_traceback_and_a_path_with_a_newline_stays_one_line(tmp_path):
    path = write(tmp_path, "bad\nname.yaml", "inherit: [1]\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    for args in (["config", "--config", str(path)], ["config", "--config", TINY, "train.seed=1e23"]):
        out = subprocess.run([sys.executable, "-m", "nagmoe", *args], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr, out.stderr[-2000:]
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_config_and_an_experiment_name_the_line_of_a_yaml_error_alike(tmp_path, capsys):
    """One YAML reader for configs and experiments (nagmoe.config.yaml_files.load_yaml): the same one-line message."""
    bad = "name: x\nseeds: [0,\n"
    config_line = one_line(capsys, ["config", "--config", write(tmp_path, "c.yaml", bad)], "invalid YAML")
    exp_line = one_line(capsys, ["experiment", write(tmp_path, "e.yaml", bad), "--slurm", "--dry-run"], "invalid YAML")
    assert "at line 3" in config_line and config_line.split("invalid YAML")[1] == exp_line.split("invalid YAML")[1]
