"""Issue 25, a bounded all-to-all: `model.moe.capacity_factor` caps each expert at ceil(f·N·K/E) routing slots of
a micro-batch in training (the first in token order), the overflow gets no expert output, evaluation stays
dropless, the drops are counted, and the gradient stays finite; on 2 gloo ranks with EP=2 a router forced to
one expert sends each rank at most that many rows per source."""
import math

import pytest
import torch

from nagmoe.config import MoEConfig
from nagmoe.model.moe import MoELayer
from nagmoe.model.router_health import RouterTelemetry

E, D, H, T = 4, 16, 16, 12


def layer(capacity_factor, K=1, gate_scale=False):
    torch.manual_seed(0)
    m = MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=H, impl="grouped",
                              capacity_factor=capacity_factor), gate_scale_output=gate_scale)
    with torch.no_grad():
        m.w_out.normal_(0.0, H ** -0.5)
    return m


def forced_to_expert(m, x, expert=2):
    """Every token's first choice is `expert` (a constant feature and one router column)."""
    x = x.clone()
    x[..., 0] = 1.0
    with torch.no_grad():
        m.router.weight[:, 0] = 0.0
        m.router.weight[expert, 0] = 20.0
    return x


def test_capacity_keeps_the_first_slots_in_token_order_and_drops_the_rest():
    m = layer(1.0)
    x = forced_to_expert(m, torch.randn(2, T, D, generator=torch.Generator().manual_seed(1)))
    capacity = math.ceil(1.0 * 2 * T * 1 / E)  # 6 of 24 tokens
    dropless = layer(None)
    dropless.load_state_dict(m.state_dict())
    y_ref = dropless(x)[0].reshape(-1, D)
    y = m.train()(x)[0].reshape(-1, D)
    torch.testing.assert_close(y[:capacity], y_ref[:capacity])  # the first tokens as without a capacity
    assert torch.equal(y[capacity:], torch.zeros_like(y[capacity:]))  # the overflow: no expert output
    assert int(m.last_stats["dropped_slots"]) == 2 * T - capacity
    assert int(m.last_stats["tokens_per_expert"][2]) == 2 * T  # routed counts stay the router's choice
    telemetry = RouterTelemetry()
    telemetry.add_tensors(m.last_stats["tokens_per_expert"][None].double(), torch.zeros(1), torch.ones(1),
                          m.last_stats["dropped_slots"].double()[None])
    assert telemetry.report()["dropped_frac"] == [pytest.approx((2 * T - capacity) / (2 * T))]
    # evaluation and generation stay dropless
    torch.testing.assert_close(m.eval()(x)[0].reshape(-1, D), y_ref)
    assert int(m.last_stats["dropped_slots"]) == 0


def test_a_token_with_every_slot_dropped_has_gate_scale_one_and_finite_gradients():
    m = layer(0.5, K=2, gate_scale=True).train()
    x = forced_to_expert(m, torch.randn(1, T, D, generator=torch.Generator().manual_seed(2))).requires_grad_(True)
    y, aux, scale = m(x)
    assert int(m.last_stats["dropped_slots"]) > 0
    assert torch.equal(scale.detach(), torch.ones_like(scale))  # S / sg(S) = 1, or 1 where nothing was kept
    (y.square().sum() + aux + (scale * torch.arange(T, dtype=scale.dtype)).sum()).backward()
    for name, p in m.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    assert torch.isfinite(x.grad).all()


def test_config_refuses_a_non_positive_factor():
    from nagmoe.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.moe.capacity_factor"):
        load_config(None, ["model.moe.capacity_factor=0"])


def _received_rows_on_ep2(factor):
    import torch.distributed as dist

    from nagmoe.config import Config
    from nagmoe.parallel.expert_parallel import AllToAllDispatcher, shard_experts
    from nagmoe.parallel.mesh import ParallelMesh

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model.ffn, cfg.model.moe.n_experts, cfg.parallel.ep = "moe", E, 2
    mesh = ParallelMesh.build(cfg, rank, W)
    m = layer(factor)
    x = forced_to_expert(m, torch.randn(W, T, D, generator=torch.Generator().manual_seed(3)))[rank:rank + 1]
    x.requires_grad_(True)  # as the stream does: every rank then joins the backward all-to-alls
    shard_experts(m, mesh)
    received = []
    real = AllToAllDispatcher.exchange_counts

    def spy(self, counts_E):
        recv_PL = real(self, counts_E)
        received.append(recv_PL.tolist())
        return recv_PL

    AllToAllDispatcher.exchange_counts = spy
    try:
        y, aux = m.train()(x)
        (y.sum() + aux).backward()
    finally:
        AllToAllDispatcher.exchange_counts = real
    return received


@pytest.mark.distributed
def test_ep2_ranks_receive_at_most_the_capacity_from_each_source():
    from gloo_ranks import run_on_ranks

    capacity = math.ceil(1.0 * T / E)  # per source rank: T tokens, top-1
    bounded = run_on_ranks(_received_rows_on_ep2, 2, 1.0)
    dropless = run_on_ranks(_received_rows_on_ep2, 2, None)
    # expert 2 lives on EP rank 1 (local expert 0): without a bound it gets every token of both sources
    assert dropless[1][0] == [[T, 0], [T, 0]]
    assert bounded[1][0] == [[capacity, 0], [capacity, 0]]
    assert all(v <= capacity for per_rank in bounded for recv in per_rank for row in recv for v in row)
