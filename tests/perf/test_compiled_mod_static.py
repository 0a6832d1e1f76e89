"""Issue 59, acceptance: with the trainer's compile on, static MoD's graphs are the same from the first step on,
across the skip start, a row with no executed token and one with all, and thresholds that change every step
(0 recompiles after step 1). CPU, aot_eager (forward and backward graphs traced as inductor would get them)."""
import torch

from nagmoe.train.speed import compile_model
from nagmoe.train.sync_count import SyncCounter
from mod_models import B, T, batch, r40_small, step, with_edge_rows


def test_static_mod_compiles_once_across_the_skip_start():
    torch._dynamo.reset()
    model = with_edge_rows(r40_small("static", **{"model.mod.start_tokens": 2 * B * T}))
    model.train()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(
            gm, example_inputs)

    compile_model(model, backend=counting_backend)
    cal = model.stream.mod
    per_step, thresholds, skipping = [], [], []
    for i in range(7):
        skipping.append(bool(cal.skipping.any()))
        step(model, *batch(10 + i))
        per_step.append(len(graphs))
        model.mod_update()
        thresholds.append(cal.threshold.clone())
    assert skipping[0] is False and skipping[-1] is True  # the run crossed the skip start
    assert all(not torch.equal(a, b) for a, b in zip(thresholds[2:], thresholds[3:]))  # new thresholds each step
    executed = cal.last_step["executed"]
    assert max(executed) < 1.0  # the last step skipped
    assert per_step[0] > 0 and per_step == [per_step[0]] * len(per_step), per_step
    with SyncCounter() as counter:  # an instrument's dispatch mode: the units run eagerly, no fullgraph error
        step(model, *batch(20))
    assert counter.total == 0, counter.counts
