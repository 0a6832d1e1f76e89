"""Issue 59, acceptance: with the trainer's compile on, static MoD's graphs are the same from the first step on,
across the skip start, a row with no executed token and one with all, and thresholds that change every step
(0 recompiles after step 1). CPU, aot_eager (forward and backward graphs traced as inductor would get them): fp32,
where the expert call runs between two graphs, and (issue 69) bf16, where `_grouped_mm` is in the graph."""
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


def test_static_mod_bf16_keeps_grouped_mm_in_the_graph_across_the_skip_start():
    """Issue 69: in bf16 (autocast, as on CUDA) the expert call stays in the compiled MoE unit: `_grouped_mm` in the
    forward and backward graphs with its offsets computed in the graph from the device counts (offs = cumsum of
    the executed slots per expert, no host value), no graph break anywhere, the same graphs at every step across
    the skip start. On the CPU torch 2.13 traces `_grouped_mm` in bf16 only (its fake kernel rejects fp32:
    "Expected inputs of BF16 type"), hence the fp32 test above runs the experts between two graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = with_edge_rows(r40_small("static", **{"model.mod.start_tokens": 2 * B * T}))
    model.train()
    graphs, fw_graphs, bw_graphs = [], [], []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: fw_graphs.append(g) or g,
                                                          bw_compiler=lambda g, _: bw_graphs.append(g) or g)(
            gm, example_inputs)

    compile_model(model, backend=counting_backend)
    cal = model.stream.mod
    per_step, skipping = [], []
    for i in range(7):
        skipping.append(bool(cal.skipping.any()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = step(model, *batch(10 + i))
        assert out.loss.isfinite() and all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
        per_step.append((len(graphs), len(fw_graphs), len(bw_graphs)))
        model.mod_update()
    assert skipping[:2] == [False, False] and skipping[-1] is True  # the run crossed the skip start
    assert max(cal.last_step["executed"]) < 1.0  # the last step skipped
    assert per_step[0][0] > 0 and per_step == [per_step[0]] * len(per_step), per_step  # no recompile
    assert not counters["graph_break"], dict(counters["graph_break"])

    def grouped_mms(gms):  # (the node, its offs argument)
        return [(n, n.args[2] if len(n.args) > 2 else n.kwargs["offs"]) for g in gms for n in g.graph.nodes
                if n.target is torch.ops.aten._grouped_mm.default]

    # forward: x·w_in and a·w_out, offs = int32(cumsum(counts_E)) computed in the graph from device counts
    forward = grouped_mms(fw_graphs)
    assert len(forward) == 2, [str(g.graph) for g in fw_graphs]
    for node, offs in forward:
        from_cumsum = any(a.target is torch.ops.aten.cumsum.default for a in offs.all_input_nodes)
        assert offs.op == "call_function" and from_cumsum, (node.format_node(), offs.format_node())
    # backward: both operands' gradients of both, on the same offsets saved from the forward
    backward = grouped_mms(bw_graphs)
    assert len(backward) == 4 and {offs.name for _, offs in backward} == {offs.name for _, offs in forward}, \
        [n.format_node() for n, _ in backward]
