"""Issue 59: `model.mod.impl=static` is the same function as `gather` with fixed shapes and no host read.

The paper's nag-mod20-r40 layout (CCA 4x, MoE top-4, NAG, global threshold) at reduced width. Skip rates are
set with the compute dial from one calibrating forward; a spy on the calibrator's `select` makes row 0 skip
every token and row 1 execute every token at every sublayer (the two edge cases of a padded layout)."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nagmoe.model.mod import Selection, resolve_mod_impl
from nagmoe.train.sync_count import SyncCounter
from mod_models import batch, dialled, r40_small, step, with_edge_rows


MOE_VARIANTS = {  # every MoE option that reads which tokens executed
    "default": {}, "capacity": {"model.moe.capacity_factor": 1.0},
    "sequence-balance": {"model.moe.lb_granularity": "sequence"},
    "global-balance": {"model.moe.lb_granularity": "global_batch"},
    "expert-bias": {"model.moe.expert_bias": "true"},
}


@pytest.mark.parametrize("rate,variant", [(0.1, "default"), (0.3, "default"), (0.5, "default")]
                         + [(0.3, v) for v in MOE_VARIANTS if v != "default"])
def test_static_equals_gather(rate, variant):
    gather = dialled(r40_small("gather", **MOE_VARIANTS[variant]), rate)
    static = copy.deepcopy(gather)  # before the spies: a deep copy would share the first spy's closure
    static.stream.mod.impl = "static"
    with_edge_rows(gather), with_edge_rows(static)
    idx, targets = batch(1)
    a, b = step(gather, idx, targets), step(static, idx, targets)
    # one function, two orders of summation (gathered rows vs masked full rows): fp32, relative 1e-5
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=1e-5, atol=1e-7)
    for (name, pa), (_, pb) in zip(gather.named_parameters(), static.named_parameters()):
        if pa.grad is None:
            assert pb.grad is None, name
            continue
        scale = pa.grad.abs().max().item()
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=name)
    ca, cb = gather.stream.mod, static.stream.mod
    for buf in ("pending_executed", "pending_tokens", "pending_padded", "pending_hist"):
        assert torch.equal(getattr(ca, buf), getattr(cb, buf)), buf
    executed = ca.pending_executed[ca.eligible] / ca.pending_tokens[ca.eligible]
    assert 0.25 < float(executed.min()) and float(executed.max()) < 0.95  # it skipped, and not everything
    for la, lb in zip(gather.blocks, static.blocks):
        assert torch.equal(la.ffn.last_stats["tokens_per_expert"], lb.ffn.last_stats["tokens_per_expert"])
        for key, value in la.ffn.last_stats.items():  # counts exact, sums within fp32 rounding
            torch.testing.assert_close(lb.ffn.last_stats[key], value, rtol=1e-5, atol=1e-6, msg=key)
        if la.ffn.balance_inputs is not None:  # global_batch: P_E and the counts the trainer all-reduces
            torch.testing.assert_close(lb.ffn.balance_inputs[0], la.ffn.balance_inputs[0], rtol=1e-5, atol=1e-7)
            assert torch.equal(lb.ffn.balance_inputs[1], la.ffn.balance_inputs[1])
    if variant == "capacity":  # the capacity really dropped slots
        assert sum(int(layer.ffn.last_stats["dropped_slots"]) for layer in gather.blocks) > 0
    assert ca.update() == cb.update()  # the same thresholds and state after the step
    assert torch.equal(ca.threshold, cb.threshold)


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in torch.utils._pytree.tree_leaves((args, kwargs or {}))
                       if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


def test_static_runs_the_same_ops_on_the_same_shapes_with_no_host_read():
    traces, executed = [], []
    for rate in (0.1, 0.3, 0.5):
        model = with_edge_rows(dialled(r40_small("static"), rate))
        idx, targets = batch(2)
        with SyncCounter() as counter, OpRecorder() as recorder:
            step(model, idx, targets)
        assert counter.total == 0, counter.counts
        traces.append(recorder.ops)
        executed.append(model.stream.mod.pending_executed.sum().item())
    assert len(set(executed)) == 3  # the counts differ ...
    assert traces[0] == traces[1] == traces[2]  # ... the ops and shapes do not


def test_gather_reads_the_host_once_per_sublayer():
    """The contrast the static path removes (and the budget tests/train/test_sync_budget.py holds)."""
    model = dialled(r40_small("gather"), 0.3)
    with SyncCounter() as counter:
        step(model, *batch(2))
    assert counter.total >= 4


def test_auto_is_static_on_cuda_only():
    from nagmoe.train.backend_report import resolved_backends

    assert resolved_backends(r40_small("static"))["MoD.impl"] == "static"  # what the run logs
    assert resolved_backends(r40_small("auto"))["MoD.impl"] == "gather"
    assert resolve_mod_impl("auto", "cuda") == "static" and resolve_mod_impl("auto", "cpu") == "gather"
    assert resolve_mod_impl("gather", "cuda") == "gather" and resolve_mod_impl("static", "cpu") == "static"


def test_static_selection_before_the_start_executes_every_token():
    """Before skipping starts the static path still hands out a Selection (same graph), all True."""
    model = r40_small("static")
    model.train()
    seen = []
    real = model.stream.mod.select
    model.stream.mod.select = lambda i, s: seen.append(real(i, s)) or seen[-1]
    step(model, *batch(3))
    assert seen and all(isinstance(s, Selection) and bool(s.mask_BT.all()) for s in seen)


# ----------------------------------------------------------------------------------------------------------
# Issue 69: the guards around `_grouped_mm`'s unwritten tail
# ----------------------------------------------------------------------------------------------------------
_REAL_GROUPED_MM = torch._grouped_mm


def _nan_past(t_SX: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """t with its rows from offs[-1] on set to NaN: what `_grouped_mm` may leave there (it writes only the rows of
    its groups; bf16 on the CPU returned non-finite values in them, fp32 zeros)."""
    rows_S1 = torch.arange(t_SX.shape[0], device=t_SX.device).unsqueeze(1)
    return torch.where(rows_S1 >= offs_E[-1], float("nan"), t_SX)


class _PoisonedGroupedMM(torch.autograd.Function):
    """`torch._grouped_mm` whose output rows past offs[-1] are NaN, and so are those of its input gradient (the
    backward's dx = grouped_mm(dy, wᵀ) leaves the same tail unwritten). Weight gradient: the real one (it sums over
    the groups' rows only)."""
    tails = 0  # calls that had a tail: the test exercised the guards

    @staticmethod
    def forward(ctx, a_SX, b_EXY, offs_E):
        ctx.save_for_backward(a_SX, b_EXY, offs_E)
        _PoisonedGroupedMM.tails += int(offs_E[-1]) < a_SX.shape[0]
        return _nan_past(_REAL_GROUPED_MM(a_SX, b_EXY, offs=offs_E), offs_E)

    @staticmethod
    def backward(ctx, g_SY):
        a_SX, b_EXY, offs_E = ctx.saved_tensors
        with torch.enable_grad():
            a, b = a_SX.detach().requires_grad_(), b_EXY.detach().requires_grad_()
            ga, gb = torch.autograd.grad(_REAL_GROUPED_MM(a, b, offs=offs_E), (a, b), g_SY)
        return _nan_past(ga, offs_E), gb, None


def test_static_keeps_a_nan_expert_tail_out_of_every_value_and_gradient(monkeypatch):
    """The output-side torch.where in MoELayer._unsort keeps the tail (read by the skipped slots through the unsort)
    out of y and of ∂gate (NaN·0 = NaN), the input-side one keeps the tail of ∂x out of the tokens: with the tail
    poisoned, forward, loss and every gradient are finite and equal gather's (which has no tail)."""
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: _PoisonedGroupedMM.apply(a, b, offs))
    gather = dialled(r40_small("gather"), 0.3)
    static = copy.deepcopy(gather)
    static.stream.mod.impl = "static"
    with_edge_rows(gather), with_edge_rows(static)
    outputs = []
    for layer in static.blocks:
        layer.ffn.register_forward_hook(lambda m, args, out: outputs.append(out[0].detach()))
    _PoisonedGroupedMM.tails = 0
    idx, targets = batch(1)
    a, b = step(gather, idx, targets), step(static, idx, targets)
    assert _PoisonedGroupedMM.tails > 0 and len(outputs) == len(static.blocks)  # the tails were there, poisoned
    bad = [f"blocks.{i}.ffn output" for i, y in enumerate(outputs) if not y.isfinite().all()]
    bad += [name for name, v in (("loss", b.loss), ("aux_loss", b.aux_loss)) if not v.isfinite()]
    bad += [name for name, p in static.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    assert not bad, f"non-finite: {bad}"
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(b.aux_loss, a.aux_loss, rtol=1e-5, atol=1e-7)
    for (name, pa), (_, pb) in zip(gather.named_parameters(), static.named_parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            scale = pa.grad.abs().max().item()
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-5 * scale + 1e-12, msg=name)
