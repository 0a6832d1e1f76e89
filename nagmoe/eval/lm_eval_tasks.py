"""nagmoe's in-context tasks (nagmoe/eval/tasks.py) as lm-evaluation-harness tasks: one YAML and one JSONL per
task in a directory for lm-eval's `--include_path`, offline (`dataset_path: json`, local `data_files`).

    multiple_choice    -> output_type multiple_choice: text = query, choices, target = gold index
    schema             -> the multiple-input form (as winogrande): text = the gold index, choices = the contexts,
                          target = the shared continuation
    language_modeling  -> output_type loglikelihood: text = context, target = continuation; `acc` = is_greedy
    rolling            -> output_type loglikelihood_rolling (`write_rolling_task`): documents scored whole, word/byte
                          perplexity and bits per byte; `nagmoe_shakespeare_scenes` holds the validation scenes

Few-shot examples are drawn by nagmoe's rule (tasks.fewshot_prefix) and baked into each document's text, so the
lm-eval task has `num_fewshot: 0` and both harnesses see the same prompts. The texts equal nagmoe's rendering:
context + continuation_delimiter + continuation. lm-eval's multiple-choice `acc` compares summed
log-probabilities: `nagmoe eval --decision sum` is the same decision.
"""
from __future__ import annotations

import json
import os
import re

import yaml

from nagmoe.eval.tasks import LANGUAGE_MODELING, MULTIPLE_CHOICE, SCHEMA, Task, fewshot_prefix
from nagmoe.base.files import write_atomic

PREFIX = "nagmoe_"


def task_name(label: str) -> str:
    return PREFIX + (re.sub(r"[^A-Za-z0-9_]+", "_", label).strip("_") or "task")[:80]


def documents(task: Task) -> list[dict]:
    docs = []
    for i, ex in enumerate(task.examples):
        prefix = fewshot_prefix(task, i)
        if task.task_type == MULTIPLE_CHOICE:
            docs.append({"query": prefix + ex["query"], "choices": list(ex["choices"]), "gold": int(ex["gold"])})
        elif task.task_type == SCHEMA:
            docs.append({"options": [prefix + o for o in ex["context_options"]], "continuation": ex["continuation"],
                         "gold": int(ex["gold"])})
        else:
            docs.append({"context": prefix + ex["context"].strip(), "continuation": ex["continuation"]})
    return docs


def task_yaml(task: Task, data_file: str) -> dict:
    common = {"task": task_name(task.label), "dataset_path": "json",
              "dataset_kwargs": {"data_files": {"test": os.path.abspath(data_file)}}, "test_split": "test",
              "num_fewshot": 0, "target_delimiter": task.continuation_delimiter,
              "metadata": {"version": 1, "source": "nagmoe", "label": task.label}}
    if task.task_type == MULTIPLE_CHOICE:
        return {**common, "output_type": "multiple_choice", "doc_to_text": "{{query}}",
                "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    if task.task_type == SCHEMA:
        return {**common, "output_type": "multiple_choice", "doc_to_text": "{{gold}}",
                "doc_to_choice": "{{options}}", "doc_to_target": "{{continuation}}",
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}
    assert task.task_type == LANGUAGE_MODELING
    return {**common, "output_type": "loglikelihood", "doc_to_text": "{{context}}", "doc_to_target": "{{continuation}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}


def write_tasks(tasks: list[Task], out_dir: str) -> list[str]:
    """Write each task as OUT_DIR/<name>.yaml + <name>.jsonl; returns the lm-eval task names."""
    os.makedirs(out_dir, exist_ok=True)
    names = []
    for task in tasks:
        name = task_name(task.label)
        data = os.path.join(out_dir, name + ".jsonl")
        write_atomic(data, "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in documents(task)))
        write_atomic(os.path.join(out_dir, name + ".yaml"), yaml.safe_dump(task_yaml(task, data), sort_keys=False))
        names.append(name)
    return names


# lm-eval's loglikelihood_rolling metrics with their registered aggregations, as its own wikitext task has them
ROLLING_METRICS = [{"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                   {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                   {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False}]
SCENES_TASK = PREFIX + "shakespeare_scenes"


def write_rolling_task(texts: list[str], out_dir: str, name: str) -> str:
    """Documents scored whole (output_type loglikelihood_rolling: word/byte perplexity, bits_per_byte)."""
    os.makedirs(out_dir, exist_ok=True)
    data = os.path.join(out_dir, name + ".jsonl")
    write_atomic(data, "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    # doc_to_target names the column, not a template: the text verbatim (Jinja would drop a trailing newline and
    # lm-eval would parse a text in brackets as a list)
    spec = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": os.path.abspath(data)}},
            "test_split": "test", "num_fewshot": 0, "output_type": "loglikelihood_rolling", "doc_to_text": "",
            "doc_to_target": "text", "should_decontaminate": False, "metric_list": ROLLING_METRICS,
            "metadata": {"version": 1, "source": "nagmoe"}}
    write_atomic(os.path.join(out_dir, name + ".yaml"), yaml.safe_dump(spec, sort_keys=False))
    return name


def write_scenes_task(val_fraction: float, out_dir: str) -> str:
    """The Shakespeare validation scenes (split by the run's val_fraction) as a rolling task: lm-eval's
    bits per byte of the run, each scene one document."""
    from nagmoe.eval.offline_task import validation_scenes

    return write_rolling_task(validation_scenes(val_fraction), out_dir, SCENES_TASK)
