"""`nagmoe eval` on the shared micro run: prints the offline task's score (and writes JSON); a malformed task file
or a bad spec exits 2 with one line naming the problem."""
import argparse
import importlib
import json

import pytest

from nagmoe import cli
from nagmoe.base.errors import UserError


def run_command(name: str, argv: list) -> int:
    """`nagmoe NAME ARGV` through the real CLI once NAME is registered there; until then the same dispatch
    (command module's add_arguments/run, UserError -> one line on stderr and exit code 2)."""
    if name in cli.COMMANDS:
        return cli.main([name, *argv])
    module = importlib.import_module(f"nagmoe.commands.{name}")
    parser = argparse.ArgumentParser(prog=f"nagmoe {name}")
    module.add_arguments(parser)
    try:
        return int(module.run(parser.parse_args(argv)) or 0)
    except UserError as e:
        import sys

        print(f"nagmoe {name}: error: {e}", file=sys.stderr)
        return 2


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_eval_prints_the_offline_task_score(micro_run, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert run_command("eval", ["--run-dir", micro_run, "--offline-items", "40", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if ln.startswith("shakespeare_next_line"))
    accuracy, centred = (float(x) for x in line.split()[-2:])
    assert 0.0 <= accuracy <= 1.0 and centred == pytest.approx((accuracy - 0.25) / 0.75, abs=1e-4)
    assert "CORE-style score" in printed
    result = json.loads(out.read_text())
    (task,) = result["tasks"]
    assert (task["label"], task["examples"], task["random_baseline"]) == ("shakespeare_next_line", 40, 25.0)
    assert result["core_metric"] == pytest.approx(task["centred"])


def test_eval_reads_a_jsonl_task_file(micro_run, tmp_path, capsys):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"task": {"label": "mine", "num_fewshot": 1}},
        {"query": "ROMEO:", "choices": ["Good morrow.", "xq zv"], "gold": 0},
        {"query": "JULIET:", "choices": ["Ay me!", "qq"], "gold": 0}]) + "\n")
    assert run_command("eval", ["--run-dir", micro_run, "--tasks", str(path), "shakespeare",
                                "--offline-items", "8"]) == 0
    printed = capsys.readouterr().out
    assert any(ln.startswith("mine ") for ln in printed.splitlines())
    assert "over 2 tasks" in printed


def test_malformed_task_file_exits_2_naming_the_line(micro_run, tmp_path, capsys):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps({"query": "q", "choices": ["a", "b"], "gold": 0}) + "\n"
                    + json.dumps({"query": "q", "choices": ["a", "b"], "gold": 0}) + "\n"
                    + '{"query": "q", "choices": ["a", "b"], "gold": 0\n')
    assert run_command("eval", ["--run-dir", micro_run, "--tasks", str(path)]) == 2
    assert f"{path}:3:" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("args, needle", [
    (["--tasks", "no_such_thing"], "no_such_thing"),
    (["--tasks", "missing.jsonl"], "missing.jsonl"),
    (["--max-per-task", "0"], "--max-per-task"),
])
def test_bad_specs_exit_2(micro_run, capsys, tmp_path, args, needle):
    assert run_command("eval", ["--run-dir", micro_run, *args]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)


def test_bundle_dir_without_core_yaml_exits_2(micro_run, tmp_path, capsys):
    assert run_command("eval", ["--run-dir", micro_run, "--tasks", str(tmp_path)]) == 2
    assert "core.yaml" in _one_error_line(capsys.readouterr().err)
