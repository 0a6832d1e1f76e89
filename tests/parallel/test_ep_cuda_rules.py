"""Expert parallelism under CUDA's autocast rules (issue 38), on 2 real gloo ranks.

A rank whose local experts receive no slot used to return `x_RD * 0.0` in the fp32 carrier dtype while the other
rank returned the experts' bf16: the return all-to-all sizes its buffers by each rank's own dtype, so this gave no
error and garbage rows. And the dispatch shipped the fp32 carrier out and fp32 gradients back. Here: the router
is forced so rank 1's experts get no slot; the EP layer equals one process running the same layer under the same
rules; every token payload of every all-to-all, forward and backward, is bf16 on both ranks."""
import pytest
import torch

from gloo_ranks import run_on_ranks
from nagmoe.cuda_rules.contracts import AllToAllPayloads

pytestmark = pytest.mark.distributed

E, D, H, T = 8, 32, 32, 16


def _layer(K):
    from nagmoe.config import MoEConfig
    from nagmoe.model.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=H, impl="grouped"))
    with torch.no_grad():
        layer.w_out.normal_(0.0, H ** -0.5)
        layer.router.weight[:, 0] = 0.0
        layer.router.weight[3, 0] = 20.0  # every token's first choice: expert 3 (rank 0 holds experts 0-3)
        layer.router.weight[2, 0] = 10.0  # its second: expert 2 -> rank 1's experts 4-7 get no slot
    return layer


def _forward_backward(layer, x, g):
    from nagmoe.cuda_rules.tier import cuda_rules_autocast

    x = x.clone().requires_grad_(True)
    with cuda_rules_autocast("2.11"):
        y, aux = layer(x)
    ((y.float() * g).sum()).backward()
    return y.detach().float(), x.grad, {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                        for n, p in layer.named_parameters()}


def _rank(K):
    import torch.distributed as dist

    from nagmoe.config import Config
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.grad_sync import sync_expert_grads
    from nagmoe.parallel.mesh import ParallelMesh

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model.ffn, cfg.model.moe.n_experts, cfg.parallel.ep = "moe", E, W
    mesh = ParallelMesh.build(cfg, rank, W)
    x = torch.randn(W, T, D, generator=torch.Generator().manual_seed(1))
    x[..., 0] = 1.0
    g = torch.randn(W, T, D, generator=torch.Generator().manual_seed(2))
    ref = _layer(K)
    y_ref, xg_ref, pg_ref = _forward_backward(ref, x, g)
    layer = _layer(K)
    names = shard_experts(layer, mesh)
    payloads = AllToAllPayloads()
    with payloads:
        y, xg, pg = _forward_backward(layer, x[rank:rank + 1], g[rank:rank + 1])
    sync_expert_grads([p for n, p in layer.named_parameters() if n in names], mesh)
    L = E // W
    w_err = max(float((_grad(layer.get_parameter(n)) * W - pg_ref[n][rank * L:(rank + 1) * L]).abs().max())
                for n in names)  # the trainer averages over ranks: EP grads are the reference's / W
    return {"y_err": float((y - y_ref[rank:rank + 1]).abs().max()), "scale": float(y_ref.abs().max()),
            "xg_err": float((xg - xg_ref[rank:rank + 1]).abs().max()), "w_err": w_err,
            "received": layer.dispatcher.take_traffic()["received"], "payloads": payloads.seen}


@pytest.mark.parametrize("K", [1, 2])
def test_an_empty_rank_returns_the_compute_dtype_and_equals_one_process(K):
    results = run_on_ranks(_rank, 2, K)
    assert results[1]["received"] == 0 and results[0]["received"] == 2 * T * K  # rank 1's experts: no slot
    for rank, r in enumerate(results):
        assert r["y_err"] <= 1e-2 * max(1.0, r["scale"]) and r["xg_err"] <= 1e-2 and r["w_err"] <= 1e-2, (rank, r)
        # forward out and back, backward out and back: four token payloads, all bf16, on both ranks alike
        assert [d for d, _ in r["payloads"]] == ["bfloat16"] * 4, (rank, r["payloads"])
    assert [d for d, _ in results[0]["payloads"]] == [d for d, _ in results[1]["payloads"]]


def _grad(p):
    return torch.zeros_like(p) if p.grad is None else p.grad  # an expert without slots gets no gradient


def _random_routing_payloads():
    import torch.distributed as dist

    from nagmoe.config import Config, MoEConfig
    from nagmoe.cuda_rules.tier import cuda_rules_autocast
    from nagmoe.model.moe import MoELayer
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.mesh import ParallelMesh

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model.ffn, cfg.model.moe.n_experts, cfg.parallel.ep = "moe", E, W
    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=2, expert_hidden=H, impl="grouped"))
    shard_experts(layer, ParallelMesh.build(cfg, rank, W))
    x = torch.randn(1, 4 * T, D, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    payloads = AllToAllPayloads()
    with payloads:
        with cuda_rules_autocast("2.11"):
            y, _ = layer(x)
        y.float().sum().backward()
    traffic = layer.dispatcher.take_traffic()
    return {"payloads": payloads.seen, "sent": traffic["sent"], "received": traffic["received"]}


def test_dispatch_payload_bytes_are_bf16_both_ways():
    """Random routing: per rank, slots out and results back in the forward, their gradients in the backward, all
    bf16: 4 x 2 bytes per row of D (12 before: the fp32 carrier out and its fp32 gradient back)."""
    for rank, r in enumerate(run_on_ranks(_random_routing_payloads, 2)):
        sizes = [b for _, b in r["payloads"]]
        assert [d for d, _ in r["payloads"]] == ["bfloat16"] * 4, (rank, r["payloads"])
        assert sum(sizes) == 2 * D * (2 * r["sent"] + 2 * r["received"]), (rank, r)


def _mismatched_payloads():
    import torch.distributed as dist

    from nagmoe.cuda_rules.contracts import payload_dtypes_agree

    rank = dist.get_rank()
    payload_dtypes_agree(torch.zeros(3, 4))  # one dtype everywhere: passes
    try:
        payload_dtypes_agree(torch.zeros(3, 4, dtype=torch.bfloat16 if rank == 0 else torch.float32))
    except RuntimeError as e:
        return str(e)
    return None


def test_the_debug_check_names_a_dtype_mismatch_on_every_rank():
    for msg in run_on_ranks(_mismatched_payloads, 2):
        assert msg is not None and "ranks ship different dtypes" in msg
