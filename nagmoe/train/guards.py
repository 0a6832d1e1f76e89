"""Training guards: the non-finite guard and the gate-collapse alarm (issue 16).

Non-finite guard. Always on and cheap: after the backward, before any optimizer step, the step's loss (a
python float, already synchronised) and the global gradient norm (computed by the clip anyway) are tested
with `isfinite`. A NaN/Inf anywhere in the gradients makes the norm non-finite, so these two numbers cover
the forward and the backward. Only when the check fires, `locate_nonfinite` re-runs the step's last
micro-batch with forward hooks on the embedding and on every sublayer (input and output, in stream order)
and names the first place that went non-finite; if the whole forward is finite it re-runs the backward and
names the first parameter whose gradient is non-finite. Then, by `train.nonfinite`:
    halt (default): no optimizer step; one line on stderr and exit code EXIT_NONFINITE (3);
    skip: gradients dropped, no optimizer step, the run continues; `nonfinite_skipped` in the metrics.
Either way weights and optimizer state never see a non-finite update.

Gate-collapse alarm. Every `train.gate_collapse_every` steps once the injection warm-up is over, one
no-grad forward with statistics gives each NAG sublayer's realised gain g = mean |alpha·m·warmup|; a gate
with g < COLLAPSED_GAIN counts as shut. When more than `train.gate_collapse_fraction` of the sublayers are
shut: a warning on stderr, `gate_collapse_alarm: true` in the metrics record (with `gate_collapsed_fraction`
on every check), and with `train.gate_collapse_stop` a checkpoint then exit code EXIT_GATE_COLLAPSE (4).
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Optional

import torch
from torch import nn

from nagmoe.base.errors import UserError

EXIT_NONFINITE = 3  # the run stopped before a non-finite update; weights and checkpoints are intact
EXIT_GATE_COLLAPSE = 4  # stopped on purpose by the gate-collapse alarm (train.gate_collapse_stop)
COLLAPSED_GAIN = 0.05  # a NAG sublayer whose mean realised gain is below this counts as shut


class TrainingHalted(SystemExit):
    """A deliberate stop with a one-line reason: ends the process with `code` (the CLI does not catch it).
    `message` is the line printed on stderr."""

    def __init__(self, message: str, code: int):
        super().__init__(code)
        self.message = message


def is_nonfinite(loss: float, grad_norm) -> bool:
    """The cheap check: the step's loss or the global gradient norm is NaN or infinite."""
    return not (math.isfinite(float(loss)) and math.isfinite(float(grad_norm)))


def sublayer_names(model: nn.Module) -> list[str]:
    """'block 1 ffn (MoELayer)' for each sublayer in stream order (index k = block k // 2)."""
    return [f"sublayer {k}: block {k // 2} {'attention' if k % 2 == 0 else 'ffn'} ({type(sub).__name__})"
            for k, sub in enumerate(model.sublayers())]


def _all_finite(value) -> bool:
    """True when every floating tensor in `value` (a tensor, or a tuple/list of them) is finite."""
    if torch.is_tensor(value):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, (tuple, list)):
        return all(_all_finite(v) for v in value)
    return True


def _first_nonfinite_in_forward(model: nn.Module, x_BT, y_BT, autocast) -> tuple[Optional[str], object]:
    """Run model(x, y) with hooks; return (where the first non-finite value appeared or None, output)."""
    names = sublayer_names(model)
    first: list[str] = []

    def note(where: str, value) -> None:
        if not first and not _all_finite(value):
            first.append(where)

    handles = [model.wte.register_forward_hook(lambda mod, inp, out: note("the token embedding", out))]
    for k, sub in enumerate(model.sublayers()):
        # a finite output of k-1 but a non-finite input of k: the residual update of k-1 (its gate) broke
        before = "the stream encode" if k == 0 else f"the residual update (NAG gate) after {names[k - 1]}"
        handles.append(sub.register_forward_pre_hook(lambda mod, inp, where=before: note(where, inp)))
        handles.append(sub.register_forward_hook(lambda mod, inp, out, where=names[k]: note(where, out)))
    try:
        with autocast:
            out = model(x_BT, y_BT)
    finally:
        for h in handles:
            h.remove()
    if not first and not (_all_finite(out.loss) and _all_finite(out.aux_loss)):
        first.append("the output head / loss (every sublayer output was finite)")
    return (first[0] if first else None), out


def locate_nonfinite(model: nn.Module, x_BT: torch.Tensor, y_BT: torch.Tensor, autocast=None,
                     allow_backward: bool = True) -> str:
    """Where a step went non-finite, as a phrase for the message (see module docstring). Re-runs the
    micro-batch in eval mode (so MoD's training histograms are untouched) and leaves the gradients zeroed.
    `allow_backward=False` (distributed wrappers, whose backward is collective) reports the forward only."""
    autocast = autocast if autocast is not None else nullcontext()
    was_training = model.training
    model.eval()
    try:
        if not allow_backward:
            with torch.no_grad():
                where, _ = _first_nonfinite_in_forward(model, x_BT, y_BT, autocast)
            return f"first non-finite output: {where}" if where else \
                "the forward is finite: non-finite gradients in the backward"
        model.zero_grad(set_to_none=True)
        where, out = _first_nonfinite_in_forward(model, x_BT, y_BT, autocast)
        if where is not None:
            return f"first non-finite output: {where}"
        (out.loss + out.aux_loss).backward()
        for name, p in model.named_parameters():
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return f"the forward is finite: first non-finite gradient in parameter {name}"
        return "not reproduced on the last micro-batch (an earlier micro-batch of the step)"
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)


def nonfinite_message(step: int, loss: float, grad_norm, where: str, mode: str) -> str:
    action = ("halting (train.nonfinite=halt; exit 3); the last checkpoint is intact" if mode == "halt"
              else "step skipped (train.nonfinite=skip)")
    return (f"non-finite training step {step + 1}: loss {float(loss)!r}, grad norm {float(grad_norm)!r}; "
            f"{where}; weights not updated; {action}")


# ----------------------------------------------------------------------------------------------------------
# Gate collapse
# ----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def realised_gains(model: nn.Module, x_BT: torch.Tensor, autocast=None) -> Optional[list[float]]:
    """Mean realised gain |alpha·m·warmup| per NAG sublayer on one batch (None for a pre-norm model). One
    no-grad forward in eval mode (MoD training histograms untouched) that stops after the blocks: the gains are
    the sublayers' statistics, and decoding would make the full (B, T, V) logits (6 GiB at the paper's
    micro-batch) every `train.gate_collapse_every` steps."""
    was_training = model.training
    model.eval()
    try:
        with autocast if autocast is not None else nullcontext():
            stats = model(x_BT, collect_stats=True, decode=False).stats
    finally:
        model.train(was_training)
    return None if stats is None or "gain_mean" not in stats else list(stats["gain_mean"])


def collapsed_fraction(gains: list[float], threshold: float = COLLAPSED_GAIN) -> float:
    """Fraction of sublayers whose mean realised gain is below `threshold`."""
    return sum(g < threshold for g in gains) / max(1, len(gains))


def gate_collapse_message(step: int, gains: list[float], fraction: float, limit: float, stop: bool) -> str:
    shut = [k for k, g in enumerate(gains) if g < COLLAPSED_GAIN]
    action = "stopping (train.gate_collapse_stop=true; exit 4)" if stop else "training continues"
    return (f"gate collapse at step {step}: {len(shut)}/{len(gains)} NAG sublayers ({fraction:.0%}, more than "
            f"train.gate_collapse_fraction={limit:g}) have mean realised gain < {COLLAPSED_GAIN} "
            f"(sublayers {shut}); {action}")


FAIL_AT_STEP_ENV = "NAGMOE_TEST_FAIL_AT_STEP"


def fail_at_step_for_a_test(step: int) -> None:
    """Test hook (tests/slurm/test_multihost.py): with NAGMOE_TEST_FAIL_AT_STEP=N, every rank raises a UserError
    (exit 2) after step N: a deterministic failure, as a config or data error found mid-run would be. Acts only
    under NAGMOE_TEST_HOOKS=1 (nagmoe.base.environment.hook_setting)."""
    from nagmoe.base.environment import hook_setting

    at = hook_setting(FAIL_AT_STEP_ENV)
    if at and at.isdigit() and step == int(at):
        raise UserError(f"test hook {FAIL_AT_STEP_ENV}: a deterministic failure after step {step}")
