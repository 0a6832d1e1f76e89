"""Issue 59, acceptance: with the trainer's compile on, static MoD's graphs are the same from the first step on,
across the skip start, a row with no executed token and one with all, and thresholds that change every step
(0 recompiles after step 1). CPU, aot_eager (forward and backward graphs traced as inductor would get them): fp32,
where the expert call runs between two graphs, and (issue 69) bf16, where `_grouped_mm` is in the graph."""
import torch

from nagmoe.train.speed import compile_model
from nagmoe.train.sync_count import SyncCounter
from mod_models import B, T, batch, r40_small, recording_backend, step, with_edge_rows


def test_static_mod_compiles_once_across_the_skip_start():
    torch._dynamo.reset()
    model = with_edge_rows(r40_small("static", **{"model.mod.start_tokens": 2 * B * T}))
    model.train()
    backend, graphs, _, _ = recording_backend()
    compile_model(model, backend=backend)
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
    # attention 1, MoE 2 (its expert call runs between them), loss chunk 1: the decision made in the MoE's own
    # frame (issue 69, item 3) adds no graph; a wrapper frame around the forward made it 5
    assert per_step[0] == 4, per_step
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
    backend, graphs, fw_graphs, bw_graphs = recording_backend()
    compile_model(model, backend=backend)
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


def test_static_mod_decides_inside_the_sublayer_graphs():
    """Issue 69, item 3: static MoD's decision — the mask (r > p_l) | ¬skipping_l, the executed counts and the
    score histogram of the calibration — is traced into each sublayer class's MoD unit. Over 7 steps across the
    skip start (bf16, as on CUDA): no graph break, the same graphs every step, the attention's and the MoE's
    forward graphs each compare the score with the threshold and bin it into the K-bin histogram, and a profiled
    step runs none of it eagerly between the units: per sublayer call only the calibrator's `record`, one
    index_add_ of the call's counts row (on the CPU a scatter_add_ on a view). Before, 41 ops a call ran there."""
    import os
    import sys

    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path[:0] = [os.path.join(repo, "tools", "bench"), os.path.join(repo, "tools", "gpu_check")]
    import step_profile

    torch._dynamo.reset()
    counters.clear()
    model = r40_small("static", **{"model.mod.start_tokens": 2 * B * T})
    model.train()
    backend, graphs, fw_graphs, _ = recording_backend()
    compile_model(model, backend=backend)
    cal = model.stream.mod
    per_step, skipping = [], []
    for i in range(7):
        skipping.append(bool(cal.skipping.any()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step(model, *batch(10 + i))
        per_step.append(len(graphs))
        model.mod_update()
    assert skipping[:2] == [False, False] and skipping[-1] is True  # the run crossed the skip start
    assert max(cal.last_step["executed"]) < 1.0  # the last step skipped
    assert per_step[0] > 0 and per_step == [per_step[0]] * len(per_step), per_step  # no recompile
    assert not counters["graph_break"], dict(counters["graph_break"])

    def decides(g):  # r > p_l on the (1,) threshold read by index, and the histogram: (K,) zeros index_add
        nodes = [n for n in g.graph.nodes if n.op == "call_function"]
        compares = [n for n in nodes if n.target is torch.ops.aten.gt.Tensor
                    and any(a.target is torch.ops.aten.index_select.default for a in n.all_input_nodes)]
        histograms = [n for n in nodes if n.target is torch.ops.aten.index_add.default
                      and tuple(n.meta["val"].shape) == (cal.bins,)]
        return len(compares) == 1 and len(histograms) == 1

    units = [type(m).__name__ for m in (model.blocks[0].attn, model.blocks[0].ffn)]
    assert sum(decides(g) for g in fw_graphs) == len(units), [str(g.graph) for g in fw_graphs]

    calls = sum(cal.eligible_list)  # one decision per eligible sublayer and forward
    with torch.autocast("cpu", dtype=torch.bfloat16), profile(activities=[ProfilerActivity.CPU],
                                                              with_stack=True) as prof:
        step(model, *batch(30))
    assert len(graphs) == per_step[0]
    eager = [(e.name, step_profile.selection_frame(e)) for e in prof.events()
             if step_profile._is_leaf_aten(e) and not step_profile._in_graph(e)]
    eager = [(name, frame) for name, frame in eager if frame is not None]  # MoD's selection, run eagerly
    assert {frame for _, frame in eager} == {"record"} and len(eager) <= 2 * calls, (len(eager), sorted(set(eager)))
    table = step_profile.region_table(prof.events(), cuda=False)  # the tool's counts (docs/benchmarks.md)
    assert table["mod_select"] == len(eager) and 0 < table["in_graph"] < table["launches"], table


def test_static_mod_counts_once_under_activation_checkpointing():
    """The decision's counts leave the compiled unit as an output, added by the calibrator after the call: a
    checkpoint's recompute (which reruns the unit in the backward and drops its outputs) cannot count a step's
    scores twice. Compiled + checkpointed equals eager: the same counts, loss and gradients."""
    from nagmoe.train.speed import enable_activation_checkpointing

    torch._dynamo.reset()
    eager = r40_small("static", **{"model.mod.start_tokens": 0})
    compiled = r40_small("static", **{"model.mod.start_tokens": 0})
    enable_activation_checkpointing(compiled)
    compile_model(compiled, backend="aot_eager")
    for model in (eager, compiled):
        model.train()
        step(model, *batch(0))  # the histograms, then a skipping step
        model.mod_update()
    a, b = step(eager, *batch(1)), step(compiled, *batch(1))
    ca, cb = eager.stream.mod, compiled.stream.mod
    assert 0 < float(ca.pending_executed.sum()) < float(ca.pending_tokens.sum())  # it skipped
    assert torch.equal(cb.pending, ca.pending)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=0)
    for (name, pa), (_, pb) in zip(eager.named_parameters(), compiled.named_parameters()):
        if pa.grad is not None:
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-5 * pa.grad.abs().max().item(), msg=name)
