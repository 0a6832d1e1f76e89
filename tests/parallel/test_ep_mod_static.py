"""Issue 59 with expert parallelism: static MoD's MoE (every token routed, the skipped tokens' slots sorted last)
sends only the executed slots through the all-to-all and equals the gather path (the executed tokens gathered)
on the same EP layer: outputs of the executed tokens, aux loss, every gradient, and the rows each rank received.
2 real gloo ranks, EP=2; rank 1's row has no executed token at all (it still joins both all-to-alls).
Issue 69: the static call reads the host once, the dispatcher's split sizes (it slices the executed slots with
them; the MoE layer reads nothing), and the whole model compiled keeps its graphs across steps (below)."""
import pytest
import torch

from gloo_ranks import run_on_ranks

pytestmark = pytest.mark.distributed

E, D, H, T, K = 4, 32, 32, 16, 2
TOL = 1e-5


def static_vs_gather():
    import torch.distributed as dist

    from nagmoe.config import Config, MoEConfig
    from nagmoe.model.mod import ExecutedTokens, Selection
    from nagmoe.model.moe import MoELayer
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.mesh import ParallelMesh
    from nagmoe.train.sync_count import SyncCounter

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model.ffn, cfg.model.moe.n_experts, cfg.parallel.ep = "moe", E, W
    mesh = ParallelMesh.build(cfg, rank, W)
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=H, impl="grouped"), gate_scale_output=True)
    with torch.no_grad():
        layer.w_out.normal_(0.0, H ** -0.5)
    shard_experts(layer, mesh)
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(1 + rank))
    mask = torch.rand(1, T, generator=torch.Generator().manual_seed(5 + rank)) > 0.4
    if rank == 1:
        mask[:] = False
    g = torch.randn(1, T, D, generator=torch.Generator().manual_seed(9 + rank))
    out, reads = {}, None
    for impl in ("gather", "static"):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        if impl == "static":
            with SyncCounter() as counter:  # the layer's forward and backward; the test's own mask reads after
                y, aux, scale = layer(xi, select=Selection(mask))
                ((y * g).sum() + aux + (scale * mask).sum()).backward()  # skipped rows: y = 0, scale 1
            reads = dict(counter.counts)
        else:
            sel = ExecutedTokens(mask, queries=False)
            y, aux, scale = layer(sel.gather(xi).unsqueeze(0))
            y, scale = y.squeeze(0), scale.squeeze(0)
            ((y * g[mask]).sum() + aux + scale.sum()).backward()
        if impl == "static":
            y = y[mask]
        out[impl] = (y.detach(), aux.detach(), xi.grad.clone(), {n: p.grad.clone() for n, p in
                                                               layer.named_parameters() if p.grad is not None},
                     layer.received_rows)
    (ya, aa, xa, pa, ra), (yb, ab, xb, pb, rb) = out["gather"], out["static"]
    errs = [(ya - yb).abs().max().item() if ya.numel() else 0.0, (aa - ab).abs().item(),
            (xa - xb).abs().max().item()] + [(pa[n] - pb[n]).abs().max().item() for n in pa]
    return max(errs), pa.keys() == pb.keys(), (ra, rb), int(mask.sum()), reads


def test_static_mod_over_expert_parallelism_equals_gather():
    results = run_on_ranks(static_vs_gather, 2)
    for rank, (err, same_params, (rows_gather, rows_static), executed, reads) in enumerate(results):
        # issue 69: one host read in the static call, forward and backward: the dispatcher's split sizes (the
        # executed slots are sliced from them there; the MoE layer reads nothing)
        assert sum(reads.values()) == 1 and all(s.startswith("nagmoe/parallel/expert_parallel.py:") for s in reads), \
            (rank, reads)
        assert same_params and err <= TOL, (rank, err)
        # only the executed slots travel: the same rows as the gathered tokens'
        assert rows_static is not None and rows_static == rows_gather, (rank, rows_gather, rows_static)
    assert results[1][3] == 0 and results[0][3] > 0


# ----------------------------------------------------------------------------------------------------------
# Issue 69: the whole model, compiled, across steps, with the host reads counted
# ----------------------------------------------------------------------------------------------------------
STEPS, SKIP_FROM, EXTREME_STEP = 6, 2, 4  # skipping starts at step 2; at step 4 rank 0 executes nothing, rank 1 all


def _steer(model, rank, phase):
    """A spy on the calibrator's `select`: row 0 executes no token and row 1 every token (with_edge_rows); while
    `phase["extreme"]`, rank 0 executes no token at all and rank 1 every one (scores 0 and 1)."""
    cal = model.stream.mod
    real = cal.select

    def select(index, score_BT):
        score_BT = score_BT.detach().clone()
        if phase["extreme"]:
            score_BT.fill_(1.0 if rank else 0.0)
        else:
            score_BT[0], score_BT[1] = 0.0, 1.0
        return real(index, score_BT)

    cal.select = select


def _max_error(b: torch.Tensor, a: torch.Tensor, scale: float) -> float:
    """max |b - a| / (scale + |a|): <= rtol passes assert_close(rtol, atol=rtol·scale), the tolerance of
    tests/model/test_mod_static.py (scale = the reference's largest entry for a gradient)."""
    return float(((b - a).abs() / (scale + a.abs())).max())


def compiled_static_vs_gather_steps():
    """On each rank: the r40 layout at reduced width (mod_models.r40_small), EP=2, gather and static on the same
    batches for STEPS steps, both compiled with aot_eager (the same decompositions; static's graphs counted).
    Returns python values only, for the parent to assert."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from nagmoe.config import Config
    from nagmoe.model.moe import MoELayer
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.mesh import ParallelMesh
    from nagmoe.train.speed import compile_model
    from nagmoe.train.sync_count import SyncCounter
    from mod_models import B, T, batch, r40_small, recording_backend, step

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model.ffn, cfg.model.moe.n_experts, cfg.parallel.ep = "moe", 8, W
    mesh = ParallelMesh.build(cfg, rank, W)
    torch._dynamo.reset()
    phase, models = {"extreme": False}, {}
    for impl in ("gather", "static"):
        model = r40_small(impl, **{"model.mod.start_tokens": SKIP_FROM * B * T})
        shard_experts(model, mesh)
        _steer(model, rank, phase)
        model.train()
        models[impl] = model
    moe_layers = [m for m in models["static"].modules() if isinstance(m, MoELayer)]
    moe_calls = [0]
    for layer in moe_layers:
        layer.register_forward_pre_hook(lambda *_: moe_calls.__setitem__(0, moe_calls[0] + 1))
    backend, graphs, _, _ = recording_backend()
    compile_model(models["static"], backend=backend)
    compile_model(models["gather"], backend="aot_eager")
    cal = models["static"].stream.mod
    out = {"graphs": [], "skipping": [], "errors": [], "thresholds": [], "sent": [], "breaks": {}}
    for i in range(STEPS):
        phase["extreme"] = i == EXTREME_STEP
        out["skipping"].append(bool(cal.skipping.any()))
        idx, targets = batch(10 + i + 100 * rank)
        a = step(models["gather"], idx, targets)
        before = counters["graph_break"].copy()
        b = step(models["static"], idx, targets)
        for reason, n in (counters["graph_break"] - before).items():  # static's breaks (traced in step 0 only)
            out["breaks"][str(reason)] = out["breaks"].get(str(reason), 0) + n
        out["graphs"].append(len(graphs))
        out["sent"].append([layer.dispatcher.take_traffic()["sent"] for layer in moe_layers])
        errs = {"loss": _max_error(b.loss.detach(), a.loss.detach(), 0.0),
                "aux": _max_error(b.aux_loss.detach(), a.aux_loss.detach(), 1e-2)}  # atol 1e-7 at rtol 1e-5
        for (name, pa), (_, pb) in zip(models["gather"].named_parameters(), models["static"].named_parameters()):
            if (pa.grad is None) != (pb.grad is None):
                errs[name] = float("inf")
            elif pa.grad is not None:
                errs[name] = _max_error(pb.grad, pa.grad, float(pa.grad.abs().max()) + 1e-12)
        out["errors"].append(errs)
        for model in models.values():
            model.mod_update()
        out["thresholds"].append(cal.threshold.tolist())
    # the host reads of one more (skipping) step: an instrument's dispatch mode runs the units eagerly
    moe_calls[0] = 0
    with SyncCounter() as counter:
        step(models["static"], *batch(30 + rank))
    out.update(reads=dict(counter.counts), moe_calls=moe_calls[0], table=counter.table(), tokens=B * T)
    return out


@pytest.mark.slow
def test_compiled_static_mod_over_expert_parallelism_reads_once_per_moe_call():
    """Issue 69: under EP the MoE layer reads nothing on the host; the dispatcher reads its split sizes once per
    call. The compiled static model (every unit fullgraph but the MoE's, which breaks only at the dispatcher) keeps
    its step-0 graphs across the skip start, new thresholds every step, a rank with no executed token and one with
    all, and equals gather (relative 1e-5, the tolerance of tests/model/test_mod_static.py)."""
    for rank, r in enumerate(run_on_ranks(compiled_static_vs_gather_steps, 2, timeout=240)):
        # 1 host read per MoE call, the dispatcher's split sizes (the backward all-to-all reuses them)
        assert r["moe_calls"] > 0 and sum(r["reads"].values()) == r["moe_calls"], (rank, r["moe_calls"], r["table"])
        assert all(site.startswith("nagmoe/parallel/expert_parallel.py:") for site in r["reads"]), r["table"]
        # the run crossed the skip start, and the thresholds moved every step since
        assert r["skipping"][SKIP_FROM - 1] is False and r["skipping"][SKIP_FROM] is True, r["skipping"]
        thresholds = r["thresholds"][SKIP_FROM - 1:]
        assert all(t0 != t1 for t0, t1 in zip(thresholds, thresholds[1:])), thresholds
        # the extreme step: rank 0 sent no slot, rank 1 every one (each token's top-4) at each MoE call
        sent = r["sent"][EXTREME_STEP]
        assert sent == [0 if rank == 0 else r["tokens"] * 4] * len(sent), (rank, sent)
        # every graph traced in step 0, none after; the only break is the dispatcher's eager call
        assert r["graphs"][0] > 0 and r["graphs"] == [r["graphs"][0]] * STEPS, (rank, r["graphs"], r["breaks"])
        assert r["breaks"] and all("MoELayer.run_experts" in k and "compiler.disable" in k for k in r["breaks"]), \
            r["breaks"]
        for i, errs in enumerate(r["errors"]):
            assert max(errs.values()) <= 1e-5, (rank, i, {k: v for k, v in errs.items() if v > 1e-5})
