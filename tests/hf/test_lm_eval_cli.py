"""lm-eval's model arguments and rolling tasks through `nagmoe eval --lm-eval`, and the `nagmoe` model from
lm-eval's own command line (issue 53 items 6-8): rolling bits per byte of the validation scenes through
`nagmoe eval --model-args add_bos_token=False`, through lm-eval's command line with `--model nagmoe` and through
lm-eval's `hf` model on the export are equal."""
import glob
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nagmoe.cli import main

ROLLING = "nagmoe_shakespeare_scenes"
SCENES = 2  # documents scored (lm-eval's --limit): whole scenes, a few dozen 64-token windows each


@pytest.fixture(scope="module")
def setup(exported_run, tmp_path_factory):
    run_dir, out = exported_run
    tasks = str(tmp_path_factory.mktemp("lm_eval_tasks_cli"))
    assert main(["eval", "--run-dir", run_dir, "--write-lm-eval-tasks", tasks, "--offline-items", "4"]) == 0
    return SimpleNamespace(run_dir=run_dir, out=out, tasks=tasks)


@pytest.fixture(scope="module")
def hf_bpb(setup):
    """Bits per byte of the rolling task by lm-eval's `hf` model on the export, add_bos_token=False."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import nagmoe.eval.lm_eval_model  # noqa: F401  (registered next to lm-eval's own models, `hf` still found)

    manager = TaskManager(include_path=setup.tasks, include_defaults=False)  # lm-eval's own ~15k YAMLs: seconds
    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={setup.out},trust_remote_code=True,dtype=float32,add_bos_token=False",
        tasks=[ROLLING], limit=SCENES, device="cpu", batch_size=16, task_manager=manager, log_samples=False,
        bootstrap_iters=0)
    return res["results"][ROLLING]["bits_per_byte,none"]


def nagmoe_loss_bits_per_byte(run, texts):
    """Summed loss over summed bytes through nagmoe's model directly, each text a document from BOS, scored in
    lm-eval's rolling windows (L targets each, the last one with a full L-token context)."""
    L, nats, nbytes = run.config.model.max_seq_len, 0.0, 0
    for text in texts:
        ids = [run.bos_id, *run.tokenizer.encode(text, add_special_tokens=False).ids]
        for a in range(1, len(ids), L):  # targets ids[a:b]
            b = min(a + L, len(ids))
            n = min(L, b - 1)
            with torch.no_grad():
                loss = run.model(torch.tensor([ids[b - 1 - n:b - 1]]), torch.tensor([ids[b - n:b]]),
                                 reduction="none").loss
            nats += float(loss.reshape(-1)[-(b - a):].sum())
        nbytes += len(text.encode("utf-8"))
    return nats / math.log(2) / nbytes


def test_written_rolling_task_runs_in_lm_eval_with_its_registered_aggregations(setup, tmp_path):
    """Item 7: `write_rolling_task` writes what lm-eval's wikitext task writes; its bits per byte is nagmoe's."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from nagmoe.eval.generate import load_run
    from nagmoe.eval.lm_eval_model import NagmoeLM
    from nagmoe.eval.lm_eval_tasks import write_rolling_task

    run = load_run(setup.run_dir)
    texts = ["ROMEO:\nBut soft, what light through yonder window breaks?", "JULIET:\nO Romeo, Romeo!\nwherefore art"]
    write_rolling_task(texts, str(tmp_path), "nagmoe_rolling_probe")
    res = lm_eval.simple_evaluate(model=NagmoeLM(run_dir=setup.run_dir, add_bos_token=False),
                                  tasks=["nagmoe_rolling_probe"],
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                                  log_samples=False, bootstrap_iters=0)["results"]["nagmoe_rolling_probe"]
    assert {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"} <= set(res)
    assert res["bits_per_byte,none"] == pytest.approx(nagmoe_loss_bits_per_byte(run, texts), rel=1e-5)
    assert res["byte_perplexity,none"] == pytest.approx(2 ** res["bits_per_byte,none"], rel=1e-9)


def test_nagmoe_eval_rolling_with_add_bos_token_false_equals_hf_on_the_export(setup, hf_bpb, tmp_path, capsys):
    """Items 6 and 7, the acceptance line: `nagmoe eval --lm-eval SCENES --model-args add_bos_token=False` on the
    rolling task `--write-lm-eval-tasks` wrote == lm-eval's `hf` on the export with the same argument (1e-4
    relative), and the output names the BOS convention."""
    out = tmp_path / "res.json"
    assert main(["eval", "--run-dir", setup.run_dir, "--lm-eval", ROLLING, "--include-path", setup.tasks,
                 "--model-args", "add_bos_token=False", "--max-per-task", str(SCENES), "--batch-size", "16",
                 "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[nagmoe] rolling tasks: add_bos_token=False (lm-eval prefixes the BOS itself)" in printed
    ours = json.load(open(out))["results"][ROLLING]["bits_per_byte,none"]
    assert ours == pytest.approx(hf_bpb, rel=1e-4), (ours, hf_bpb)


def test_model_args_refuse_unknown_keys_and_bad_values_in_one_bounded_line(setup, capsys):
    for arg, needle in [("add_bos=False", "'add_bos'"), ("add_bos_token=maybe", "'maybe'"),
                        ("max_length=0", "max_length"), ("run_dir=x", "--run-dir"), ("add_bos_token", "key=value"),
                        ("x" * 100_000 + "=1", "model-args"), ("add_bos_token=" + "y" * 100_000, "add_bos_token")]:
        assert main(["eval", "--run-dir", setup.run_dir, "--lm-eval", ROLLING, "--include-path", setup.tasks,
                     "--model-args", arg]) == 2, arg[:40]
        err = capsys.readouterr().err
        assert needle in err and len(err) < 600 and err.count("\n") == 1, err[:300]


def test_lm_eval_command_line_runs_the_nagmoe_model(setup, hf_bpb, tmp_path):
    """Item 8: the README's command (`python -m nagmoe.eval.lm_eval_cli`, lm-eval's own command line with the
    `nagmoe` model registered) runs the rolling task on the run, offline, and agrees with `hf` on the export."""
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "nagmoe.eval.lm_eval_cli", "run", "--model", "nagmoe", "--model_args",
           f"run_dir={setup.run_dir},add_bos_token=False", "--tasks", ROLLING, "--include_path", setup.tasks,
           "--device", "cpu", "--batch_size", "16", "--limit", str(SCENES), "--output_path", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    assert found, proc.stdout[-2000:]
    bpb = json.load(open(found[0]))["results"][ROLLING]["bits_per_byte,none"]
    assert bpb == pytest.approx(hf_bpb, rel=1e-4), (bpb, hf_bpb)
