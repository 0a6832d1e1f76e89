"""CORE-style scoring of in-context tasks (`nagmoe.eval.tasks`) with a trained model.

Legend: B rows (token sequences) per forward, T positions, V vocabulary.

Every prompt is tokenised as a training document starts: BOS, then its tokens. For one example the texts of
`render_prompts` become rows; the scored span of each row [start, end) is found in token space, as nanochat does:
- multiple choice: the options share the context, so `start` = the longest common token prefix of the rows;
- schema: the options share the continuation, so the span is the longest common token suffix;
- language modelling: `start` = the common prefix of the prompt without and with the continuation.
A span is never empty: the shared part is shortened by one token where a tokenisation leaves an option with no
token of its own. Token t of a row is predicted at position t - 1, so the span's losses are `loss[start-1:end-1]`.
Rows longer than the model's context keep their last `max_seq_len` tokens (the few-shot prefix is cut first).

Decisions: multiple choice and schema pick the option with the lowest **mean** token loss over its span
(ties: the first); language modelling is correct iff the argmax at every span position is the span's token.
Accuracy is centred as `(acc - 0.01·rb) / (1 - 0.01·rb)` with rb the random baseline in percent, and the
CORE-style score is the mean centred accuracy over the tasks.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from nagmoe.base.errors import UserError
from nagmoe.eval.tasks import LANGUAGE_MODELING, MULTIPLE_CHOICE, SHUFFLE_SEED, Task, centred_accuracy, render_prompts

# rows x positions x vocabulary of fp32 logits held at once (~1 GiB)
LOGIT_BUDGET = 1 << 28


@dataclass
class ScoredRow:
    ids: list  # BOS + tokens, possibly cropped on the left
    start: int  # first scored token
    end: int  # one past the last scored token


@dataclass
class TaskResult:
    label: str
    task_type: str
    num_fewshot: int
    examples: int
    accuracy: float
    random_baseline: float  # percent
    centred: float

    def as_dict(self) -> dict:
        return asdict(self)


def inference_context(device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (as training), plain fp32 elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------
# Token spans
# ----------------------------------------------------------------------------------------------------------
def common_prefix(rows: list) -> int:
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return n


def common_suffix(rows: list) -> int:
    return common_prefix([r[::-1] for r in rows])


def example_rows(task: Task, index: int, encode: Callable[[str], list], bos_id: int,
                 max_len: Optional[int] = None) -> list[ScoredRow]:
    """The rows of example `index` with their scored spans (see the module docstring)."""
    rows = [[bos_id, *encode(text)] for text in render_prompts(task, index)]
    if task.task_type == LANGUAGE_MODELING:
        without, with_ = rows
        start = min(common_prefix([without, with_]), len(with_) - 1)
        scored = [ScoredRow(with_, start, len(with_))]
    elif task.task_type == MULTIPLE_CHOICE:
        start = min(common_prefix(rows), min(len(r) for r in rows) - 1)
        scored = [ScoredRow(r, start, len(r)) for r in rows]
    else:  # schema: shared continuation = common suffix, at least one token, never the whole row
        suffix = max(1, min(common_suffix(rows), min(len(r) for r in rows) - 1))
        scored = [ScoredRow(r, len(r) - suffix, len(r)) for r in rows]
    if max_len is not None:
        scored = [_crop(row, max_len, task, index) for row in scored]
    return scored


def _crop(row: ScoredRow, max_len: int, task: Task, index: int) -> ScoredRow:
    extra = len(row.ids) - max_len
    if extra <= 0:
        return row
    if row.start - extra < 1:
        raise UserError(f"{task.where(index)}: the scored continuation ({row.end - row.start} tokens) does not fit "
                        f"in the model's context of {max_len} tokens")
    return ScoredRow(row.ids[extra:], row.start - extra, row.end - extra)


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def row_losses_and_hits(model, rows: list[ScoredRow], pad_id: int, device) -> list[tuple[float, bool]]:
    """For each row: (mean loss over its span in nats, whether the argmax matched every span token).
    Rows are right-padded with `pad_id` (causal attention: padding after a row never reaches it)."""
    T = max(len(r.ids) for r in rows)
    ids_BT = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids_BT[i, :len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
    ids_BT = ids_BT.to(device)
    with inference_context(device):
        logits_BTV = model(ids_BT).logits
    logits_BTV = logits_BTV[:, :-1].float()
    loss_BT = F.cross_entropy(logits_BTV.flatten(0, 1), ids_BT[:, 1:].flatten(), reduction="none").view(len(rows), -1)
    hit_BT = logits_BTV.argmax(-1) == ids_BT[:, 1:]
    out = []
    for i, r in enumerate(rows):
        span = slice(r.start - 1, r.end - 1)
        out.append((float(loss_BT[i, span].mean()), bool(hit_BT[i, span].all())))
    return out


def _rows_per_forward(vocab_size: int, longest: int) -> int:
    return max(1, LOGIT_BUDGET // max(1, vocab_size * longest))


def score_examples(model, task: Task, encode: Callable[[str], list], bos_id: int, device,
                   max_len: Optional[int] = None, batch_rows: int = 32, decision: str = "mean") -> list[bool]:
    """Whether each example of `task` is answered correctly (examples batched into forwards of ~batch_rows);
    `decision` (nagmoe.eval.task_specs.DECISIONS) is how options are compared."""
    vocab = model.config.vocab_size
    correct: list[bool] = []
    pending: list[tuple[int, list[ScoredRow]]] = []

    def flush():
        rows = [r for _, example in pending for r in example]
        results = []
        longest = max(len(r.ids) for r in rows)
        step = min(batch_rows, _rows_per_forward(vocab, longest))
        for lo in range(0, len(rows), step):
            results.extend(row_losses_and_hits(model, rows[lo:lo + step], bos_id, device))
        k = 0
        for index, example in pending:
            scores = results[k:k + len(example)]
            k += len(example)
            if task.task_type == LANGUAGE_MODELING:
                correct.append(scores[0][1])
            else:
                losses = [s[0] * ((r.end - r.start) if decision == "sum" else 1) for s, r in zip(scores, example)]
                correct.append(losses.index(min(losses)) == task.examples[index]["gold"])
        pending.clear()

    for index in range(len(task.examples)):
        pending.append((index, example_rows(task, index, encode, bos_id, max_len)))
        if sum(len(e) for _, e in pending) >= batch_rows:
            flush()
    if pending:
        flush()
    return correct


def subset(task: Task, max_examples: Optional[int]) -> Task:
    """The task's examples shuffled with Random(1337) (nanochat's order) and cut to `max_examples`."""
    order = list(range(len(task.examples)))
    random.Random(SHUFFLE_SEED).shuffle(order)
    if max_examples is not None and max_examples > 0:
        order = order[:max_examples]
    lines = [task.lines[i] for i in order] if task.lines else []
    return Task(task.label, task.task_type, [task.examples[i] for i in order], task.num_fewshot,
                task.continuation_delimiter, task.random_baseline, task.source, lines)


def evaluate_task(model, task: Task, encode: Callable[[str], list], bos_id: int, device="cpu",
                  max_examples: Optional[int] = None, max_len: Optional[int] = None,
                  shuffle: bool = True, decision: str = "mean") -> TaskResult:
    """Accuracy and centred accuracy of one task."""
    task = subset(task, max_examples) if shuffle else task
    was_training = model.training
    model.eval()
    try:
        correct = score_examples(model, task, encode, bos_id, device, max_len, decision=decision)
    finally:
        model.train(was_training)
    accuracy = sum(correct) / len(correct)
    return TaskResult(task.label, task.task_type, task.num_fewshot, len(correct), accuracy, task.random_baseline,
                      centred_accuracy(accuracy, task.random_baseline))


def evaluate_tasks(model, tasks: list[Task], encode: Callable[[str], list], bos_id: int, device="cpu",
                   max_examples: Optional[int] = None, max_len: Optional[int] = None,
                   on_result: Optional[Callable[[TaskResult], None]] = None, decision: str = "mean") -> dict:
    """{"tasks": [TaskResult dicts], "core_metric": mean centred accuracy}; `on_result` sees each task's result
    as soon as it is known (the command prints it)."""
    results = []
    for task in tasks:
        result = evaluate_task(model, task, encode, bos_id, device, max_examples, max_len, decision=decision)
        if on_result is not None:
            on_result(result)
        results.append(result)
    core = sum(r.centred for r in results) / len(results) if results else float("nan")
    return {"tasks": [r.as_dict() for r in results], "core_metric": core}


def tokenizer_encoder(tokenizer) -> Callable[[str], list]:
    """`encode(text) -> ids` for an HF `tokenizers.Tokenizer`, special-token text kept as text (as training)."""
    tokenizer.encode_special_tokens = True

    def encode(text: str) -> list:
        return tokenizer.encode(text, add_special_tokens=False).ids

    return encode
