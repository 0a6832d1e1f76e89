"""Issue 59 with expert parallelism: static MoD's MoE (every token routed, the skipped tokens' slots sorted last)
sends only the executed slots through the all-to-all and equals the gather path (the executed tokens gathered)
on the same EP layer: outputs of the executed tokens, aux loss, every gradient, and the rows each rank received.
2 real gloo ranks, EP=2; rank 1's row has no executed token at all (it still joins both all-to-alls)."""
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
    out = {}
    for impl in ("gather", "static"):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        if impl == "static":
            y, aux, scale = layer(xi, select=Selection(mask))
            y = y[mask]
            scale = scale[mask]
        else:
            sel = ExecutedTokens(mask, queries=False)
            y, aux, scale = layer(sel.gather(xi).unsqueeze(0))
            y, scale = y.squeeze(0), scale.squeeze(0)
        ((y * g[mask]).sum() + aux + scale.sum()).backward()
        out[impl] = (y.detach(), aux.detach(), xi.grad.clone(), {n: p.grad.clone() for n, p in
                                                               layer.named_parameters() if p.grad is not None},
                     layer.received_rows)
    (ya, aa, xa, pa, ra), (yb, ab, xb, pb, rb) = out["gather"], out["static"]
    errs = [(ya - yb).abs().max().item() if ya.numel() else 0.0, (aa - ab).abs().item(),
            (xa - xb).abs().max().item()] + [(pa[n] - pb[n]).abs().max().item() for n in pa]
    return max(errs), pa.keys() == pb.keys(), (ra, rb), int(mask.sum())


def test_static_mod_over_expert_parallelism_equals_gather():
    results = run_on_ranks(static_vs_gather, 2)
    for rank, (err, same_params, (rows_gather, rows_static), executed) in enumerate(results):
        assert same_params and err <= TOL, (rank, err)
        # only the executed slots travel: the same rows as the gathered tokens'
        assert rows_static is not None and rows_static == rows_gather, (rank, rows_gather, rows_static)
    assert results[1][3] == 0 and results[0][3] > 0
