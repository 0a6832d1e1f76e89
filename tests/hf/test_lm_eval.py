"""lm-evaluation-harness, offline, on the export (lm-eval's `hf` model) and on the native run (our `nagmoe`
model) (issue 42 item 4): per-request log-likelihoods agree, batch sizes agree, `acc` agrees with our evaluator's
`decision=sum`, rolling bits per byte equals our bpb, and lm-eval's own command line runs on the export."""
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

ITEMS = 24
NEXT_LINE = "nagmoe_shakespeare_next_line"  # next to it in the tasks dir: the rolling nagmoe_shakespeare_scenes


@pytest.fixture(scope="module")
def setup(exported_run, tmp_path_factory):
    from lm_eval.models.huggingface import HFLM

    from nagmoe.eval.lm_eval_model import NagmoeLM

    run_dir, out = exported_run
    tasks = str(tmp_path_factory.mktemp("lm_eval_tasks"))
    assert main(["eval", "--run-dir", run_dir, "--write-lm-eval-tasks", tasks, "--offline-items", str(ITEMS)]) == 0

    def hf(**kw):
        return HFLM(pretrained=out, trust_remote_code=True, dtype="float32", device="cpu", **kw)
    return SimpleNamespace(run_dir=run_dir, out=out, tasks=tasks, hf=hf,
                           native=lambda **kw: NagmoeLM(run_dir=run_dir, **kw))


def requests(tasks_dir):
    """(context, continuation) of every option of the converted Shakespeare task, as lm-eval builds them."""
    docs = [json.loads(line) for line in open(os.path.join(tasks_dir, NEXT_LINE + ".jsonl"))]
    import yaml

    delim = yaml.safe_load(open(os.path.join(tasks_dir, NEXT_LINE + ".yaml")))["target_delimiter"]
    return docs, [SimpleNamespace(args=(d["query"], delim + c)) for d in docs for c in d["choices"]]


def test_converted_task_is_zero_shot_with_choices_differing_after_the_delimiter(setup):
    """What makes our span (after the options' common prefix) and lm-eval's (delimiter + choice) decide alike: the
    options part right after the shared delimiter token, so the two sums differ by one term common to all."""
    import yaml

    docs, _ = requests(setup.tasks)
    from nagmoe.eval.generate import load_run

    run = load_run(setup.run_dir)
    assert len(docs) == ITEMS
    spec = yaml.safe_load(open(os.path.join(setup.tasks, NEXT_LINE + ".yaml")))
    assert spec["num_fewshot"] == 0 and spec["output_type"] == "multiple_choice"
    delim = spec["target_delimiter"]
    for d in docs:
        heads = [run.tokenizer.encode(delim + c, add_special_tokens=False).ids[:2] for c in d["choices"]]
        assert len({h[0] for h in heads}) == 1 and len({h[1] for h in heads}) > 1


def test_per_request_loglikelihoods_agree_and_batch_size_does_not_matter(setup):
    _, reqs = requests(setup.tasks)
    hf8 = setup.hf(batch_size=8).loglikelihood(reqs)
    hf1 = setup.hf(batch_size=1).loglikelihood(reqs)
    ours8 = setup.native(batch_size=8).loglikelihood(reqs)
    ours1 = setup.native(batch_size=1).loglikelihood(reqs)
    for a, b, c, d in zip(hf8, hf1, ours8, ours1):
        assert abs(a[0] - c[0]) <= 1e-4 and a[1] == c[1]
        assert abs(a[0] - b[0]) <= 1e-4 and abs(c[0] - d[0]) <= 1e-4 and a[1] == b[1] and c[1] == d[1]


def test_acc_of_both_harness_models_equals_our_decision_sum(setup, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=setup.tasks, include_defaults=False)  # lm-eval's own YAMLs: seconds
    task = "nagmoe_shakespeare_next_line"
    accs = []
    for model in (setup.hf(batch_size=8), setup.native(batch_size=8)):
        res = lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager, log_samples=False,
                                      bootstrap_iters=0)
        accs.append(res["results"][task]["acc,none"])
    ours = tmp_path / "ours.json"
    assert main(["eval", "--run-dir", setup.run_dir, "--offline-items", str(ITEMS), "--decision", "sum",
                 "--out", str(ours)]) == 0
    mine = json.load(open(ours))["tasks"][0]["accuracy"]
    assert accs[0] == accs[1] == pytest.approx(mine, abs=1e-12), (accs, mine)


def rolling_texts(run, n=6, max_tokens=50):
    from nagmoe.eval.offline_task import is_text_line, validation_scenes

    texts = []
    for scene in validation_scenes(run.config.data.val_fraction):
        lines = [line for line in scene.splitlines() if is_text_line(line)]
        for i in range(0, len(lines) - 1, 2):
            text = "\n".join(lines[i:i + 2])
            if len(run.tokenizer.encode(text, add_special_tokens=False).ids) < max_tokens:
                texts.append(text)
            if len(texts) == n:
                return texts
    return texts


def test_rolling_bits_per_byte_equals_our_bpb(setup):
    from nagmoe.eval.generate import load_run

    run = load_run(setup.run_dir)
    texts = rolling_texts(run)
    assert len(texts) == 6
    reqs = [SimpleNamespace(args=(t,)) for t in texts]
    hf = setup.hf(batch_size=4, add_bos_token=False).loglikelihood_rolling(reqs)
    ours = setup.native(batch_size=4, add_bos_token=False).loglikelihood_rolling(reqs)
    for text, a, b in zip(texts, hf, ours):
        assert abs(a - b) <= 1e-4
        ids = [run.bos_id, *run.tokenizer.encode(text, add_special_tokens=False).ids]
        with torch.no_grad():
            loss = run.model(torch.tensor([ids[:-1]]), torch.tensor([ids[1:]]), reduction="none").loss.sum()
        nbytes = len(text.encode("utf-8"))
        assert abs(-b / math.log(2) / nbytes - float(loss) / math.log(2) / nbytes) <= 1e-4


def test_nagmoe_eval_lm_eval_writes_results(setup, tmp_path, capsys):
    out = tmp_path / "res.json"
    assert main(["eval", "--run-dir", setup.run_dir, "--lm-eval", "nagmoe_shakespeare_next_line",
                 "--include-path", setup.tasks, "--max-per-task", "8", "--out", str(out)]) == 0
    assert "acc,none" in json.load(open(out))["results"]["nagmoe_shakespeare_next_line"]
    capsys.readouterr()
    assert main(["eval", "--run-dir", setup.run_dir, "--lm-eval", "x", "--tasks", "shakespeare"]) == 2
    assert "not both" in capsys.readouterr().err


def test_the_lm_eval_command_line_runs_on_the_export(setup, tmp_path):
    out = tmp_path / "results"
    cmd = [os.path.join(os.path.dirname(sys.executable), "lm-eval"), "run", "--model", "hf", "--model_args",
           f"pretrained={setup.out},trust_remote_code=True,dtype=float32", "--tasks", "nagmoe_shakespeare_next_line",
           "--include_path", setup.tasks, "--device", "cpu", "--batch_size", "8", "--limit", "8",
           "--output_path", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    assert found and "nagmoe_shakespeare_next_line" in json.load(open(found[0]))["results"]


def test_generate_until_agrees_between_the_export_and_the_run(setup):
    """lm-eval's generate_until: `hf` left-pads the batch (the export's attention mask), ours runs each request with
    nagmoe's cache; greedy texts cut at the stop strings are equal."""
    prompts = ["ROMEO:\nWhat", "JULIET:\nO Romeo", "First Citizen:\n"]
    reqs = [SimpleNamespace(args=(p, {"until": ["###"], "max_gen_toks": 16, "do_sample": False})) for p in prompts]
    hf = setup.hf(batch_size=3).generate_until(reqs)
    ours = setup.native().generate_until(reqs)
    assert hf == ours and any(len(t) > 5 for t in ours)
