"""In-context evaluation tasks: reading them from local files, and rendering few-shot prompts.

Three task types (the DCLM / nanochat CORE protocol):
- `multiple_choice`: a shared query, several continuations; the model picks the choice with the lowest mean
  token loss over the continuation.
- `schema`: several contexts, one shared continuation; the model picks the context under which the
  continuation has the lowest mean token loss.
- `language_modeling`: a context and a continuation; correct iff greedy decoding reproduces every
  continuation token exactly (argmax at each position, teacher-forced).

Our JSONL task file (one task per file; blank lines are skipped; extra keys are ignored):

    {"task": {"label": "my_task", "type": "multiple_choice", "num_fewshot": 3,
              "continuation_delimiter": " ", "random_baseline": 25}}          <- optional header, line 1
    {"query": "The sky is", "choices": ["blue", "made of cheese"], "gold": 0}   <- multiple_choice
    {"context_options": ["The cat", "The car"], "continuation": "purred.", "gold": 0}   <- schema
    {"context": "Two plus two is", "continuation": "four"}                   <- language_modeling

Without a header the label is the file name without `.jsonl`, the type is read from the first example's keys,
`num_fewshot` is 0, the delimiter " ", and the random baseline (in percent, as CORE's metadata) is the mean of
100 / (number of options) over the examples (0 for language modelling). Every line is checked when read; a
bad line is a `UserError` "PATH:LINE: what is wrong".

nanochat's CORE bundle (a local copy; it is a download, this code never fetches it) is a directory with
`core.yaml` (`icl_tasks:` a list of {label, icl_task_type, dataset_uri, num_fewshot: [k], continuation_delimiter}),
`eval_meta_data.csv` (columns `Eval Task`, `Random baseline` in percent) and `eval_data/<dataset_uri>` JSONL files
in the formats above. `load_tasks` accepts the bundle directory (or its parent holding `eval_bundle/`).

Prompt rendering (as nanochat's templates): few-shot examples are drawn for example i with
`random.Random(1234 + i)` from the other examples; each is rendered as its (gold) prompt, separated from the next
by a blank line, followed by the test prompt. A multiple-choice prompt is `query + delimiter + choice`; a schema
prompt `context_option + delimiter + continuation`; a language-modelling prompt `context.strip() + delimiter +
continuation` (the prompt without the continuation is stripped of trailing whitespace).
"""
from __future__ import annotations

import csv
import json
import os
import random
from dataclasses import dataclass, field
from typing import Optional

import yaml

from nagmoe.base.errors import UserError

MULTIPLE_CHOICE, SCHEMA, LANGUAGE_MODELING = "multiple_choice", "schema", "language_modeling"
TASK_TYPES = (MULTIPLE_CHOICE, SCHEMA, LANGUAGE_MODELING)
HEADER_KEYS = ("label", "type", "num_fewshot", "continuation_delimiter", "random_baseline")
FEWSHOT_SEED, SHUFFLE_SEED = 1234, 1337  # nanochat's seeds, so scores are comparable


@dataclass
class Task:
    label: str
    task_type: str
    examples: list  # dicts in the format of task_type
    num_fewshot: int = 0
    continuation_delimiter: str = " "
    random_baseline: float = 0.0  # percent, as in CORE's eval_meta_data.csv
    source: str = ""
    lines: list = field(default_factory=list)  # source line of each example (for error messages)

    def where(self, i: int) -> str:
        return f"{self.source}:{self.lines[i]}" if self.lines else f"{self.label} example {i}"


# ----------------------------------------------------------------------------------------------------------
# Validation of one example
# ----------------------------------------------------------------------------------------------------------
def infer_type(example: dict) -> Optional[str]:
    if "choices" in example:
        return MULTIPLE_CHOICE
    if "context_options" in example:
        return SCHEMA
    if "context" in example and "continuation" in example:
        return LANGUAGE_MODELING
    return None


def _check_str(example: dict, key: str) -> str:
    v = example.get(key)
    if not isinstance(v, str):
        raise ValueError(f"'{key}' must be a string, got {type(v).__name__}" if key in example else f"no '{key}'")
    return v


def _check_options(example: dict, key: str) -> list:
    v = example.get(key)
    if not isinstance(v, list) or len(v) < 2 or not all(isinstance(c, str) for c in v):
        raise ValueError(f"'{key}' must be a list of at least 2 strings" if key in example else f"no '{key}'")
    gold = example.get("gold")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(v):
        raise ValueError(f"'gold' must be an integer in [0, {len(v)}), got {gold!r}")
    return v


def check_example(example, task_type: str) -> None:
    """ValueError naming the problem when `example` is not a valid example of `task_type`."""
    if not isinstance(example, dict):
        raise ValueError(f"expected a JSON object, got {type(example).__name__}")
    if task_type == MULTIPLE_CHOICE:
        _check_str(example, "query")
        _check_options(example, "choices")
    elif task_type == SCHEMA:
        _check_options(example, "context_options")
        _check_str(example, "continuation")
    elif task_type == LANGUAGE_MODELING:
        _check_str(example, "context")
        if not _check_str(example, "continuation").strip():
            raise ValueError("'continuation' is empty")
    else:
        raise ValueError(f"unknown task type {task_type!r} (one of {', '.join(TASK_TYPES)})")


def default_random_baseline(task_type: str, examples: list) -> float:
    """Chance accuracy in percent: mean of 100 / options over the examples; 0 for exact-match tasks."""
    if task_type == LANGUAGE_MODELING or not examples:
        return 0.0
    key = "choices" if task_type == MULTIPLE_CHOICE else "context_options"
    return 100.0 * sum(1.0 / len(e[key]) for e in examples) / len(examples)


# ----------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------
def _read_header(obj: dict, where: str) -> dict:
    header = obj["task"]
    if not isinstance(header, dict):
        raise UserError(f"{where}: 'task' header must be an object")
    unknown = [k for k in header if k not in HEADER_KEYS]
    if unknown:
        raise UserError(f"{where}: unknown task header key '{unknown[0]}' (known: {', '.join(HEADER_KEYS)})")
    if "type" in header and header["type"] not in TASK_TYPES:
        raise UserError(f"{where}: task type {header['type']!r} is not one of {', '.join(TASK_TYPES)}")
    shots = header.get("num_fewshot", 0)
    if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
        raise UserError(f"{where}: 'num_fewshot' must be an integer >= 0, got {shots!r}")
    if not isinstance(header.get("continuation_delimiter", " "), str):
        raise UserError(f"{where}: 'continuation_delimiter' must be a string")
    rb = header.get("random_baseline")
    if rb is not None and (not isinstance(rb, (int, float)) or isinstance(rb, bool) or not 0 <= rb < 100):
        raise UserError(f"{where}: 'random_baseline' must be a percentage in [0, 100), got {rb!r}")
    return header


def read_jsonl_task(path: str, label: Optional[str] = None, task_type: Optional[str] = None,
                    num_fewshot: Optional[int] = None, continuation_delimiter: Optional[str] = None,
                    random_baseline: Optional[float] = None) -> Task:
    """One task from a JSONL file (format in the module docstring). Arguments override the file's header."""
    if not os.path.isfile(path):
        raise UserError(f"--tasks: task file not found: {path}")
    header: dict = {}
    examples, lines = [], []
    with open(path, encoding="utf-8") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if isinstance(obj, dict) and "task" in obj and not examples and not header:
                header = _read_header(obj, where)
                continue
            kind = task_type or header.get("type") or (infer_type(obj) if isinstance(obj, dict) else None)
            if kind is None:
                raise UserError(f"{where}: cannot tell the task type (expected 'choices', 'context_options' or "
                                "'context' + 'continuation')")
            task_type = kind
            try:
                check_example(obj, kind)
            except ValueError as e:
                raise UserError(f"{where}: bad {kind} example: {e}") from None
            examples.append(obj)
            lines.append(line_no)
    if not examples:
        raise UserError(f"{path}: no examples")
    label = label or header.get("label") or os.path.basename(path).removesuffix(".jsonl")
    rb = random_baseline if random_baseline is not None else header.get("random_baseline")
    return Task(label=label, task_type=task_type, examples=examples,
                num_fewshot=num_fewshot if num_fewshot is not None else header.get("num_fewshot", 0),
                continuation_delimiter=(continuation_delimiter if continuation_delimiter is not None
                                        else header.get("continuation_delimiter", " ")),
                random_baseline=float(rb) if rb is not None else default_random_baseline(task_type, examples),
                source=path, lines=lines)


def find_core_bundle(path: str) -> Optional[str]:
    """The bundle directory (holding core.yaml) at `path` or `path/eval_bundle`, else None."""
    for candidate in (path, os.path.join(path, "eval_bundle")):
        if os.path.isfile(os.path.join(candidate, "core.yaml")):
            return candidate
    return None


def _show(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _cut(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bundle_file(bundle_dir: str, uri, where: str) -> str:
    """`bundle_dir/eval_data/<uri>` for a relative `uri` that stays inside eval_data/ ("sub/task.jsonl" is fine);
    an absolute path, `..`, `.`, an empty component, a backslash or a NUL byte is a UserError (a bundle may come
    from someone else: its core.yaml must not name files outside it)."""
    names = uri.split("/") if isinstance(uri, str) else []
    if (not names or uri.startswith("/") or "\\" in uri or "\0" in uri
            or any(n in ("", ".", "..") for n in names)):
        raise UserError(f"{where} {_show(uri)} must be a relative path inside eval_data/ (no '..', not absolute)")
    return os.path.join(bundle_dir, "eval_data", *names)


def read_core_bundle(bundle_dir: str) -> list[Task]:
    """All tasks of a local nanochat CORE bundle (core.yaml + eval_meta_data.csv + eval_data/)."""
    from nagmoe.config import yaml_load

    config_path = os.path.join(bundle_dir, "core.yaml")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = yaml_load(f) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise UserError(f"{config_path}: unreadable ({_cut(str(e).splitlines()[0] if str(e) else type(e).__name__)})") \
            from None
    entries = config.get("icl_tasks") if isinstance(config, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{config_path}: expected a non-empty 'icl_tasks' list")
    baselines = {}
    meta_path = os.path.join(bundle_dir, "eval_meta_data.csv")
    if os.path.isfile(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            for row in csv.DictReader(f):
                try:
                    baselines[row["Eval Task"]] = float(row["Random baseline"])
                except (KeyError, TypeError, ValueError):
                    raise UserError(f"{meta_path}: needs columns 'Eval Task' and 'Random baseline' (a number)") \
                        from None
    tasks = []
    for n, entry in enumerate(entries):
        where = f"{config_path}: icl_tasks[{n}]"
        if not isinstance(entry, dict) or not {"label", "icl_task_type", "dataset_uri"} <= set(entry):
            raise UserError(f"{where}: needs label, icl_task_type and dataset_uri")
        shots = entry.get("num_fewshot", [0])
        shots = shots[0] if isinstance(shots, list) and shots else shots
        if type(shots) is not int or shots < 0:
            raise UserError(f"{where}: num_fewshot must be an integer >= 0 (or a list of one), got {_show(shots)}")
        if entry["icl_task_type"] not in TASK_TYPES:
            raise UserError(f"{where}: icl_task_type {_show(entry['icl_task_type'])} is not one of "
                            f"{', '.join(TASK_TYPES)}")
        delimiter = entry.get("continuation_delimiter", " ")
        if not isinstance(delimiter, str):
            raise UserError(f"{where}: continuation_delimiter must be a string, got {_show(delimiter)}")
        data_path = bundle_file(bundle_dir, entry["dataset_uri"], f"{where}: dataset_uri")
        label = str(entry["label"])
        tasks.append(read_jsonl_task(data_path, label=label, task_type=entry["icl_task_type"],
                                     num_fewshot=shots, random_baseline=baselines.get(label),
                                     continuation_delimiter=delimiter))
    return tasks


# ----------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------
def fewshot_examples(task: Task, index: int) -> list:
    """The few-shot examples of example `index`: num_fewshot others, drawn with Random(1234 + index)."""
    k = min(task.num_fewshot, len(task.examples) - 1)
    if k <= 0:
        return []
    others = [i for i in range(len(task.examples)) if i != index]
    return [task.examples[i] for i in random.Random(FEWSHOT_SEED + index).sample(others, k)]


def _shot_text(task_type: str, ex: dict, delim: str) -> str:
    if task_type == MULTIPLE_CHOICE:
        return ex["query"] + delim + ex["choices"][ex["gold"]]
    if task_type == SCHEMA:
        return ex["context_options"][ex["gold"]] + delim + ex["continuation"]
    return ex["context"].strip() + delim + ex["continuation"]


def fewshot_prefix(task: Task, index: int) -> str:
    """The few-shot examples of example `index`, each rendered as its gold prompt and followed by a blank line."""
    delim = task.continuation_delimiter
    return "".join(_shot_text(task.task_type, s, delim) + "\n\n" for s in fewshot_examples(task, index))


def render_prompts(task: Task, index: int) -> list[str]:
    """The full texts whose continuation losses decide example `index`:
    multiple choice / schema: one text per option; language modelling: [without, with] the continuation."""
    ex, delim = task.examples[index], task.continuation_delimiter
    prefix = fewshot_prefix(task, index)
    if task.task_type == MULTIPLE_CHOICE:
        return [prefix + ex["query"] + delim + choice for choice in ex["choices"]]
    if task.task_type == SCHEMA:
        return [prefix + option + delim + ex["continuation"] for option in ex["context_options"]]
    without = prefix + ex["context"].strip() + delim
    return [without.rstrip(), without + ex["continuation"]]


def centred_accuracy(accuracy: float, random_baseline: float) -> float:
    """(acc - 0.01·rb) / (1 - 0.01·rb), rb the random baseline in percent: 0 at chance, 1 when perfect."""
    return (accuracy - 0.01 * random_baseline) / (1.0 - 0.01 * random_baseline)
