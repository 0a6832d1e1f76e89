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
    from nagmoe.train.trainer import resolved_backends

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
