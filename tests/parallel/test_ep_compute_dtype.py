"""Expert parallelism in the experts' compute dtype under plain CPU bf16 autocast (issue 38).

1. A rank whose local experts receive no slot used to return `x_RD * 0.0` in the fp32 carrier dtype while the
   ranks that computed returned the experts' bf16: the return all-to-all sizes its buffers by each rank's own
   dtype, so it gave no error and garbage rows. Here the router is forced so rank 1's experts get no slot, and
   the EP layer (output, input gradient, expert and router gradients, gathered) equals one process.
2. The dispatch shipped the fp32 carrier out and fp32 gradients back. Here every token payload, forward and
   backward, is bf16 on every rank (the slot copy itself: tests/cuda_rules/test_moe_dispatch_dtype.py).
"""
import pytest
import torch

from gloo_ranks import run_on_ranks
from nagmoe.cuda_rules.contracts import AllToAllPayloads

E, D, H, T = 8, 32, 32, 16


def _autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _forced_layer(K, impl="grouped"):
    from nagmoe.config import MoEConfig
    from nagmoe.model.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=H, impl=impl))
    with torch.no_grad():
        layer.w_out.normal_(0.0, H ** -0.5)
        layer.router.weight[:, 0] = 0.0  # x[..., 0] = 1: these logits dominate every token's routing
        layer.router.weight[3, 0] = 20.0  # first choice expert 3, second expert 2: both on rank 0 (experts 0-3),
        layer.router.weight[2, 0] = 10.0  # so rank 1's experts 4-7 get no slot
    return layer


def _grads(layer):
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in layer.named_parameters()}


def _forward(layer, x):
    x = x.clone().requires_grad_(True)
    with _autocast():
        y, _ = layer(x)
    return x, y


def _backward(layer, x, y, g):
    (y.float() * g).sum().backward()
    return x.grad, _grads(layer)


def _gather(t):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _empty_rank(K):
    import torch.distributed as dist

    from nagmoe.config import Config
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.mesh import ParallelMesh

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model.ffn, cfg.model.moe.n_experts, cfg.parallel.ep = "moe", E, W
    x = torch.randn(W, T, D, generator=torch.Generator().manual_seed(1))
    x[..., 0] = 1.0
    g = torch.randn(W, T, D, generator=torch.Generator().manual_seed(2))
    ref = _forced_layer(K)  # one process: all tokens, all experts
    x_ref, y_ref = _forward(ref, x)
    xg_ref, pg_ref = _backward(ref, x_ref, y_ref, g)
    scale = {n: float(t.float().abs().max()) for n, t in {"y": y_ref, "x.grad": xg_ref, **pg_ref}.items()}

    layer = _forced_layer(K)
    shard_experts(layer, ParallelMesh.build(cfg, rank, W))
    x_r, y = _forward(layer, x[rank:rank + 1])
    out = {"dtype": str(y.dtype), "received": layer.dispatcher.take_traffic()["received"], "scale": scale,
           "errs": {"y": float((_gather(y.detach().float()) - y_ref.float()).abs().max())}}
    dtypes = _gather(torch.tensor([y.element_size()]))
    if (dtypes != dtypes[0]).any():  # the defect: report the forward rather than crash the backward all-to-all
        return out
    xg, pg = _backward(layer, x_r, y, g[rank:rank + 1])
    # each rank's expert grads already sum every source's tokens (the backward all-to-all); the router's is local
    dist.all_reduce(pg["router.weight"])
    errs = {"x.grad": _gather(xg) - xg_ref, **{n: (p if n == "router.weight" else _gather(p)) - pg_ref[n]
                                              for n, p in pg.items()}}
    out["errs"].update({n: float(e.abs().max()) for n, e in errs.items()})
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("K", [1, 2])
def test_a_rank_without_slots_returns_the_compute_dtype_and_equals_one_process(K):
    results = run_on_ranks(_empty_rank, 2, K)
    assert [r["received"] for r in results] == [2 * T * K, 0]  # rank 1's experts: no slot
    assert [r["dtype"] for r in results] == ["torch.bfloat16"] * 2, [(r["dtype"], r["errs"]["y"]) for r in results]  # y: the same dtype on both ranks
    for rank, r in enumerate(results):
        assert len(r["errs"]) == 5, r  # y, x.grad, router, w_in, w_out
        for name, err in r["errs"].items():  # the same bf16 ops on the same rows: equal up to summation order
            assert err <= 1e-2 * r["scale"][name], (rank, name, err, r["scale"][name])


def _random_routing_payloads(impl):
    import torch.distributed as dist

    from nagmoe.config import Config, MoEConfig
    from nagmoe.model.moe import MoELayer
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.mesh import ParallelMesh

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model.ffn, cfg.model.moe.n_experts, cfg.parallel.ep = "moe", E, W
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=2, expert_hidden=H, impl=impl))
    shard_experts(layer, ParallelMesh.build(cfg, rank, W))
    x = torch.randn(1, 4 * T, D, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    payloads = AllToAllPayloads()
    with payloads:
        with _autocast():
            y, _ = layer(x)
        y.float().sum().backward()
    traffic = layer.dispatcher.take_traffic()
    return {"payloads": payloads.seen, "sent": traffic["sent"], "received": traffic["received"],
            "finite": bool(torch.isfinite(x.grad).all())}


@pytest.mark.distributed
@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_every_token_payload_is_bf16_both_ways(impl):
    """Per rank: slots out and results back (forward), their gradients (backward): four bf16 payloads of
    2 bytes x D per row (before: 12 bytes x D per slot row, the fp32 carrier out and its fp32 gradient back)."""
    results = run_on_ranks(_random_routing_payloads, 2, impl)
    for rank, r in enumerate(results):
        assert [d for d, _ in r["payloads"]] == ["bfloat16"] * 4, (rank, r["payloads"])
        assert sum(b for _, b in r["payloads"]) == 2 * D * (2 * r["sent"] + 2 * r["received"]), (rank, r)
        assert r["finite"] and r["sent"] > 0 and r["received"] > 0, (rank, r)
    assert results[0]["payloads"][0][0] == results[1]["payloads"][0][0]
