"""`nagmoe generate` on the shared micro run: prints the prompt and a completion; the cached decode equals
re-running the full sequence; bad run dirs and arguments exit 2 with one line."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from nagmoe.cli import main


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_generate_command_prints_prompt_and_completion(micro_run):
    r = subprocess.run([sys.executable, "-m", "nagmoe", "generate", "--run-dir", micro_run, "--prompt", "ROMEO:",
                        "--max-new-tokens", "12", "--seed", "3"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and len(r.stdout.strip()) > len("ROMEO:")


def test_cached_decoding_equals_full_recompute_on_the_trained_model(micro_run):
    from nagmoe.eval.generate import generate_ids, generate_text, load_run

    run = load_run(micro_run)
    assert run.config.model.attention.kind == "cca" and not run.model.training
    prompt = [run.bos_id, *run.tokenizer.encode("KING HENRY:", add_special_tokens=False).ids]
    greedy = generate_ids(run.model, prompt, 16, temperature=0.0)
    assert greedy == generate_ids(run.model, prompt, 16, temperature=0.0, use_cache=False)
    sampled = [generate_ids(run.model, prompt, 16, 1.0, 5, torch.Generator().manual_seed(7), use_cache=c)
               for c in (True, False)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 16
    assert generate_text(run, "Now,", 8, seed=1) == generate_text(run, "Now,", 8, seed=1)


def test_missing_or_bad_run_dir_exits_2(micro_run, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert main(["generate", "--run-dir", missing, "--prompt", "x"]) == 2
    assert missing in _one_error_line(capsys.readouterr().err)

    assert main(["generate", "--run-dir", str(tmp_path), "--prompt", "x"]) == 2
    assert "config.yaml" in _one_error_line(capsys.readouterr().err)

    untrained = tmp_path / "untrained"  # a run dir whose training never wrote a checkpoint
    untrained.mkdir()
    shutil.copy(os.path.join(micro_run, "config.yaml"), untrained / "config.yaml")
    assert main(["generate", "--run-dir", str(untrained), "--prompt", "x"]) == 2
    assert "checkpoint" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("args, needle", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-k", "-2"], "--top-k"),
    (["--max-new-tokens", "500"], "max_seq_len"),
])
def test_bad_arguments_exit_2(micro_run, capsys, args, needle):
    assert main(["generate", "--run-dir", micro_run, "--prompt", "x", *args]) == 2
    assert needle in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("command", [["generate", "--prompt", "To be", "--max-new-tokens", "2"],
                                     ["export-hf", "--no-validate"]])
def test_a_skip_rate_for_a_run_without_mod_is_the_commands_one_line(micro_run, tmp_path, capsys, command):
    """The model raises a plain SkipRateUnavailable (it knows no command line, issue 54); the commands that take
    --skip-rate word it as theirs: one line naming the flag, exit 2, nothing written."""
    out = tmp_path / "export"
    extra = ["--out", str(out)] if command[0] == "export-hf" else []
    assert main([command[0], "--run-dir", micro_run, *command[1:], *extra, "--skip-rate", "0.2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"nagmoe {command[0]}: error: --skip-rate: this model was trained without MoD" in err[0]
    assert not out.exists()


def test_the_model_refuses_a_dial_without_naming_a_command_line_flag(micro_run):
    from nagmoe.base.errors import UserError
    from nagmoe.eval.generate import load_run
    from nagmoe.model.mod_calibration import SkipRateUnavailable

    run = load_run(micro_run, "cpu")
    with pytest.raises(SkipRateUnavailable) as caught:
        run.model.set_mod_skip_rate(0.2)
    assert not isinstance(caught.value, UserError) and "--" not in str(caught.value)
