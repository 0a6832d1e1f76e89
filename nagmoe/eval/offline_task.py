"""A small offline multiple-choice task from the Shakespeare corpus, so a demo run reports a score without any
download: **pick the true next line of a scene among distractors**.

Built only from **validation-split scenes** (`is_val_document(text, data.val_fraction)`, the hash rule the data
pipeline splits by), so a model trained on the Shakespeare corpus has never seen these lines; the choice is
deterministic from `seed`.

Each item:
- the true line: a line of verse or prose (not a heading, speaker name, stage direction or blank line) of at
  least `MIN_LINE_CHARS` characters, with at least one line of the scene before it;
- the query: the `context_lines` lines of the scene before it (speaker names and blank lines included, as in the
  training documents), joined by newlines;
- the choices: the true line and `n_choices - 1` distractors, text lines drawn from the *other* validation
  scenes (never equal to the true line), in a shuffled order; `gold` is the position of the true line;
- the delimiter is a newline, no few-shot examples, random baseline 100 / n_choices percent.
Scored like any multiple-choice task (lowest mean token loss over the line).
"""
from __future__ import annotations

import random
from typing import Iterable, Optional

from nagmoe.base.errors import UserError
from nagmoe.eval.tasks import MULTIPLE_CHOICE, Task

LABEL = "shakespeare_next_line"
MIN_LINE_CHARS = 12


def is_text_line(line: str) -> bool:
    """A line a character speaks: not blank, not a heading, not a **SPEAKER** line, not an _stage direction_."""
    s = line.strip()
    if len(s) < MIN_LINE_CHARS or s.startswith("#"):
        return False
    if s.startswith("**") and s.endswith("**"):
        return False
    return not (s.startswith("_") and s.endswith("_"))


def validation_scenes(val_fraction: float) -> list[str]:
    """The Shakespeare scenes of the validation split for this `val_fraction`, in corpus order."""
    from nagmoe.data.corpus import is_val_document, iter_documents, resolve_corpus

    try:
        corpus = resolve_corpus("shakespeare")
    except UserError as e:
        raise UserError(f"the {LABEL} task needs the offline Shakespeare corpus ({e})") from None
    return [d for d in iter_documents(corpus) if is_val_document(d, val_fraction)]


def build_next_line_task(documents: Iterable[str], n_items: int = 200, n_choices: int = 4, context_lines: int = 4,
                         seed: int = 0, label: str = LABEL) -> Task:
    """The next-line task over `documents` (scenes); at most `n_items` items (fewer if the scenes hold fewer)."""
    if n_items < 1 or n_choices < 2 or context_lines < 1:
        raise UserError(f"next-line task: n_items {n_items} must be >= 1, n_choices {n_choices} >= 2, "
                        f"context_lines {context_lines} >= 1")
    scenes = [doc.splitlines() for doc in documents]
    text_lines = [[i for i, ln in enumerate(lines) if is_text_line(ln)] for lines in scenes]
    candidates = [(s, i) for s, idx in enumerate(text_lines) for i in idx if i >= 1]
    if len(scenes) < 2 or not candidates:
        raise UserError(f"next-line task: needs at least 2 scenes with text lines, got {len(scenes)} scenes")
    rng = random.Random(seed)
    picked = rng.sample(candidates, min(n_items, len(candidates)))
    examples = []
    for s, i in picked:
        true_line = scenes[s][i].strip()
        query = "\n".join(scenes[s][max(0, i - context_lines):i])
        distractors: list[str] = []
        for _ in range(1000 * n_choices):  # bounded: tiny inputs may not hold enough distinct lines
            if len(distractors) == n_choices - 1:
                break
            other = rng.randrange(len(scenes))
            if other == s or not text_lines[other]:
                continue
            line = scenes[other][rng.choice(text_lines[other])].strip()
            if line != true_line and line not in distractors:
                distractors.append(line)
        if len(distractors) < n_choices - 1:
            raise UserError(f"next-line task: the other scenes hold fewer than {n_choices - 1} distinct lines")
        choices = [true_line, *distractors]
        rng.shuffle(choices)
        examples.append({"query": query, "choices": choices, "gold": choices.index(true_line)})
    return Task(label=label, task_type=MULTIPLE_CHOICE, examples=examples, num_fewshot=0,
                continuation_delimiter="\n", random_baseline=100.0 / n_choices, source=f"<{label}>")


def shakespeare_next_line_task(val_fraction: float = 0.05, n_items: int = 200, seed: int = 0,
                               n_choices: int = 4, documents: Optional[list] = None) -> Task:
    """The offline task from the validation scenes of the Shakespeare corpus (`documents` overrides them)."""
    docs = documents if documents is not None else validation_scenes(val_fraction)
    return build_next_line_task(docs, n_items=n_items, n_choices=n_choices, seed=seed)
