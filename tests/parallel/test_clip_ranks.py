"""Global gradient clipping under expert parallelism (issue 43 item 4), on synthetic per-rank gradients over 2
gloo ranks (EP=2): the norm is sqrt(|replicated|² + Σ over EP ranks |local experts|²) — the norm one process
holding every expert computes — including a rank whose experts got no token (no gradient at all); every rank
scales by the same coefficient."""
import math
import os

import pytest
import torch

from gloo_ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.distributed

REPLICATED = torch.tensor([3.0, -1.0, 2.0])  # after DDP: the same on every rank
EXPERTS = {0: torch.tensor([[1.0, 2.0], [0.5, -0.5]]), 1: None}  # rank 1's experts routed no token


def clip_on_rank(max_norm):
    import torch.distributed as dist

    from nagmoe.config import load_config
    from nagmoe.parallel.grad_sync import clip_grad_norm_
    from nagmoe.parallel.mesh import ParallelMesh

    rank = dist.get_rank()
    mesh = ParallelMesh.from_process_group(load_config(os.path.join(REPO, "configs/tiny.yaml"), ["parallel.ep=2"]))
    rep = torch.nn.Parameter(torch.zeros(3))
    rep.grad = REPLICATED.clone()
    exp = torch.nn.Parameter(torch.zeros(2, 2))
    exp.grad = None if EXPERTS[rank] is None else EXPERTS[rank].clone()
    norm = clip_grad_norm_([rep], [exp], max_norm, mesh)
    return {"norm": float(norm), "rep": rep.grad.tolist(), "exp": None if exp.grad is None else exp.grad.tolist()}


@pytest.mark.parametrize("max_norm", [1.0, 100.0])
def test_the_global_norm_counts_every_expert_once_and_every_rank_clips_alike(max_norm):
    ranks = run_on_ranks(clip_on_rank, 2, max_norm, timeout=120)
    want = math.sqrt(float(REPLICATED.square().sum()) + float(EXPERTS[0].square().sum()))
    coef = min(1.0, max_norm / (want + 1e-6))
    for r in ranks:
        assert r["norm"] == pytest.approx(want, rel=1e-6)
        assert r["rep"] == pytest.approx((REPLICATED * coef).tolist(), rel=1e-6)
    assert ranks[0]["exp"] == [pytest.approx(row, rel=1e-6) for row in (EXPERTS[0] * coef).tolist()]
    assert ranks[1]["exp"] is None
    assert (coef < 1.0) == (max_norm == 1.0)
