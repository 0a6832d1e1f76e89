"""Distributed Muon (nagmoe.parallel.distributed_muon): the Newton-Schulz work split over the ranks that replicate
each matrix, the results exchanged.

On 4 real gloo ranks, DP 2 x EP 2 (the micro MoE model, 3 blocks, experts 32 x 48 so expert stacks come in two
shapes; the mesh, expert sharding and replication the trainer uses), STEPS Muon steps on synthetic gradients
(the same full gradients as one process; each EP rank takes its experts' slice) against single-process Muon:
  * parameters equal single-rank Muon within FP32_RTOL of each parameter's total update (fp32);
  * replicated parameters and momentum buffers are bitwise identical on all 4 ranks, expert stacks and their
    momentum on the 2 ranks of each dp group; momentum equals the single process's (bitwise);
  * the work is split: over the ranks every matrix is orthogonalised exactly once per step (counted by wrapping
    `orthogonalise`), each rank's Newton-Schulz cost is within one matrix per bucket of 1/group size of its
    groups' work, and the calls are batched (at most one per bucket).
Without processes: the plan (every matrix once, floor/ceil shares, deterministic) and groups of one rank (one
process) running exactly today's per-parameter step.
"""
import os
import zlib

import numpy as np
import pytest
import torch

from gloo_ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEPS = 4
WORLD, EP = 4, 2
MODEL = ["model.n_layers=3", "model.moe.expert_hidden=48", f"parallel.ep={EP}", "train.weight_decay=0.1"]


@pytest.fixture(scope="module")
def overrides(request):
    root = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    return [*root.MICRO_OVERRIDES, *MODEL]


def load(overrides):
    from nagmoe.config import load_config

    return load_config(os.path.join(REPO, "configs/tiny.yaml"), overrides)


def full_grad(name, shape, step):
    """The step's gradient of parameter `name` (its full, unsharded shape): the same in every process;
    matrices at very different scales (Newton-Schulz normalises each one separately)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 100 + step)
    g = torch.randn(*shape, generator=gen)
    if g.ndim == 3:
        g *= torch.logspace(-2, 2, g.shape[0]).view(-1, 1, 1)
    return g


class KernelCount:
    """Wraps the Newton-Schulz kernel (nagmoe.ops.newton_schulz.orthogonalise, also nagmoe.train.optim's): the matrices (and their Newton-Schulz cost) each call got."""

    def __init__(self, module):
        self.module, self.inner = module, module.orthogonalise
        self.calls: list[list[tuple]] = [[]]

    def __call__(self, g, *args, **kw):
        rows, cols = g.shape[-2:]
        self.calls[-1].append((g.numel() // (rows * cols), rows, cols))
        return self.inner(g, *args, **kw)

    def next_step(self):
        self.calls.append([])


def muon_steps(overrides, distributed, ns_dtype=None):
    """Build the model (the same seed everywhere), shard its experts on the mesh (distributed), run STEPS
    Muon steps on the synthetic gradients; parameters, momentum and kernel calls by step."""
    from nagmoe.model import build_model
    from nagmoe.parallel.distributed_muon import muon_replication
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.mesh import ParallelMesh
    from nagmoe.train import optim

    cfg = load(overrides if distributed else [*overrides, "parallel.ep=1"])
    mesh = ParallelMesh.from_process_group(cfg) if distributed else ParallelMesh()
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    initial = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    expert_names = shard_experts(model, mesh)
    bundle = optim.build_optimizers(model, cfg.train, ns_dtype=ns_dtype,
                                    replication=muon_replication(mesh, expert_names))
    muon = bundle.by_kind["muon"]
    names = bundle.muon_param_names()
    table = dict(model.named_parameters())
    from nagmoe.ops import newton_schulz

    count = KernelCount(optim)
    optim.orthogonalise = newton_schulz.orthogonalise = count  # one rank's Muon and the distributed step
    try:
        for step in range(STEPS):
            for name in names:
                p = table[name]
                if name in expert_names:
                    L = p.shape[0]
                    g = full_grad(name, (L * mesh.ep, *p.shape[1:]), step)[mesh.ep_rank * L:(mesh.ep_rank + 1) * L]
                else:
                    g = full_grad(name, p.shape, step)
                p.grad = g.clone()
            muon.step()
            if step < STEPS - 1:
                count.next_step()
    finally:
        optim.orthogonalise = newton_schulz.orthogonalise = count.inner
    if initial and expert_names:  # the initial slice of this rank's experts
        L = table[expert_names[0]].shape[0]
        initial = {n: v[mesh.ep_rank * L:(mesh.ep_rank + 1) * L] if n in expert_names else v
                   for n, v in initial.items()}
    return {"rank": mesh.rank, "ep_rank": mesh.ep_rank, "dp_rank": mesh.dp_rank, "expert_names": expert_names,
            "muon_names": names, "initial": {n: initial[n] for n in names},
            "params": {n: table[n].detach().numpy().copy() for n in names},
            "momentum": {n: muon.state[table[n]]["momentum_buffer"].numpy().copy() for n in names},
            "calls": count.calls,
            "reported": muon.sharded.last_matrices if muon.sharded is not None else None,
            "replication": muon.replication.describe() if muon.replication is not None else None}


@pytest.fixture(scope="module")
def single(overrides):
    return muon_steps(overrides, distributed=False)


@pytest.fixture(scope="module")
def ranks(overrides):
    return run_on_ranks(muon_steps, WORLD, overrides, True, timeout=120)


def assemble(results, name):
    """A parameter's (or momentum's) full value from the ranks of dp rank 0, experts in EP-rank order."""
    by_ep = {r["ep_rank"]: r for r in results if r["dp_rank"] == 0}
    if name not in results[0]["expert_names"]:
        return lambda key: results[0][key][name]
    return lambda key: np.concatenate([by_ep[e][key][name] for e in range(EP)])


# ----------------------------------------------------------------------------------------------------------
# 4 gloo ranks, DP 2 x EP 2
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_distributed_muon_equals_single_rank_muon(ranks, single):
    from nagmoe.parallel.distributed_muon import FP32_RTOL

    assert "dp" in ranks[0]["replication"] and "world" in ranks[0]["replication"]
    experts = ranks[0]["expert_names"]
    assert experts and all(n in ranks[0]["muon_names"] for n in experts)
    assert ranks[0]["params"][experts[0]].shape[0] * EP == single["params"][experts[0]].shape[0]
    for name in single["muon_names"]:
        got = assemble(ranks, name)
        want_update = single["params"][name] - single["initial"][name]
        update = got("params") - got("initial")
        assert np.abs(want_update).max() > 0, name
        err = np.abs(update - want_update).max() / np.abs(want_update).max()
        assert err <= FP32_RTOL, (name, err)
        np.testing.assert_allclose(got("params"), single["params"][name], rtol=FP32_RTOL, atol=0, err_msg=name)
        np.testing.assert_array_equal(got("momentum"), single["momentum"][name], err_msg=name)


@pytest.mark.distributed
def test_bf16_distributed_muon_is_within_the_bf16_tolerance_of_single_rank_muon(overrides):
    """The GPU's numerics on CPU: Newton-Schulz in bf16 (CUDA's default) on 2 gloo ranks, DP 2, results sent in
    bf16, against one process's bf16 Muon: each update within BF16_RTOL (relative Frobenius), both ranks
    bitwise equal."""
    from nagmoe.parallel.distributed_muon import BF16_RTOL

    dp2 = [*overrides, "parallel.ep=1"]
    single = muon_steps(dp2, False, torch.bfloat16)
    ranks = run_on_ranks(muon_steps, 2, dp2, True, torch.bfloat16, timeout=120)
    def matrices(result):  # matrices orthogonalised in the first step
        return sum(batch for batch, _, _ in result["calls"][0])

    assert "world" in ranks[0]["replication"]
    assert matrices(ranks[0]) + matrices(ranks[1]) == matrices(single) > matrices(ranks[0]) > 0  # split
    for name in single["muon_names"]:
        want = single["params"][name] - single["initial"][name]
        got = ranks[0]["params"][name] - ranks[0]["initial"][name]
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= BF16_RTOL, (name, err)
        np.testing.assert_array_equal(ranks[1]["params"][name], ranks[0]["params"][name], err_msg=name)


@pytest.mark.distributed
def test_every_rank_ends_with_identical_parameters_and_momentum(ranks):
    experts = set(ranks[0]["expert_names"])
    for r in ranks[1:]:
        for name in ranks[0]["muon_names"]:
            if name in experts:
                continue
            np.testing.assert_array_equal(r["params"][name], ranks[0]["params"][name], err_msg=name)
            np.testing.assert_array_equal(r["momentum"][name], ranks[0]["momentum"][name], err_msg=name)
    for a in ranks:  # expert stacks: the same on the ranks of a dp group (same EP rank)
        for b in ranks:
            if a["rank"] < b["rank"] and a["ep_rank"] == b["ep_rank"]:
                for name in experts:
                    np.testing.assert_array_equal(a["params"][name], b["params"][name], err_msg=name)
                    np.testing.assert_array_equal(a["momentum"][name], b["momentum"][name], err_msg=name)


@pytest.mark.distributed
def test_the_newton_schulz_work_is_split(ranks, single):
    from nagmoe.parallel.distributed_muon import matrix_cost

    def matrices(calls):
        return sum(n for n, _, _ in calls)

    def cost(calls):
        return sum(n * matrix_cost(r, c) for n, r, c in calls)

    experts = set(ranks[0]["expert_names"])
    shapes = {n: single["params"][n].shape for n in single["muon_names"]}
    world_work = [(1 if len(s) == 2 else s[0], *s[-2:]) for n, s in shapes.items() if n not in experts]
    # one dp group's work: its EP rank's expert slices (the same shapes for both EP ranks)
    dp_work = [(s[0] // EP, *s[-2:]) for n, s in shapes.items() if n in experts]
    n_buckets = len({(r, c) for _, r, c in world_work}) + len({(r, c) for _, r, c in dp_work})
    biggest = max(matrix_cost(r, c) for _, r, c in world_work + dp_work)
    ideal = cost(world_work) / WORLD + cost(dp_work) / (WORLD // EP)
    for step in range(STEPS):
        total = matrices(single["calls"][step])
        assert sum(matrices(r["calls"][step]) for r in ranks) == total  # every matrix exactly once
        for r in ranks:
            mine = r["calls"][step]
            assert 0 < matrices(mine) < total / 2, (r["rank"], mine)
            assert len(mine) <= n_buckets  # batched: at most one call per bucket (shape)
            assert cost(mine) <= ideal + n_buckets * biggest, (r["rank"], cost(mine), ideal)
    for r in ranks:
        assert r["reported"] == matrices(r["calls"][-1])
    # 2 stacks of 2 local experts x 3 blocks per shape in a dp group of 2: exactly 3 + 3 matrices per rank
    for r in ranks:
        expert_shapes = [(n, rows, cols) for n, rows, cols in r["calls"][-1] if rows * cols == 32 * 48]
        assert matrices(expert_shapes) == 6, r["calls"][-1]


# ----------------------------------------------------------------------------------------------------------
# Without processes
# ----------------------------------------------------------------------------------------------------------
def _specs(group_sizes_and_items):
    from nagmoe.parallel.distributed_muon import MatrixSpec, ReplicaGroup

    specs = []
    for ranks, items in group_sizes_and_items:
        group = ReplicaGroup(tuple(ranks), None, "g")
        specs += [MatrixSpec(group, n, r, c, torch.float32, 5, torch.float32) for n, r, c in items]
    return specs


def test_plan_assigns_every_matrix_once_in_balanced_contiguous_runs():
    from nagmoe.parallel.distributed_muon import matrix_cost, plan_exchanges

    world = range(4)
    specs = _specs([(world, [(1, 16, 32)] * 9 + [(1, 32, 16)] * 3 + [(5, 64, 128)]),
                    ((0, 2), [(3, 32, 48), (3, 48, 32), (1, 32, 48)]), ((1, 3), [(3, 32, 48)]),
                    ((2,), [(7, 8, 8)])])  # a group of one rank: not in the plan
    plan = plan_exchanges(specs)
    assert [ex.group.ranks for ex in plan] == [(0, 1, 2, 3), (0, 2), (1, 3)]
    assert plan_exchanges(specs)[0].fingerprint() == plan[0].fingerprint()  # deterministic
    seen = {}
    load = {r: 0 for r in world}
    for ex in plan:
        for b in ex.buckets:
            n_total = sum(b.counts)
            assert max(b.counts) - min(b.counts) <= 1 and min(b.counts) == n_total // ex.group.size
            for m, segs in enumerate(b.segments):
                assert sum(s.hi - s.lo for s in segs) == b.counts[m]
                load[ex.group.ranks[m]] += b.counts[m] * matrix_cost(b.rows, b.cols)
                for s in segs:
                    assert specs[s.item].rows == b.rows and specs[s.item].cols == b.cols
                    for k in range(s.lo, s.hi):
                        assert (s.item, k) not in seen
                        seen[(s.item, k)] = ex.group.ranks[m]
    assert set(seen) == {(i, k) for i, s in enumerate(specs) if s.group.size > 1 for k in range(s.count)}
    # leftovers go to the least loaded: 5 large (2, 1, 1, 1), then 9 + 3 small ones mostly to ranks 1-3
    counts = {(b.rows, b.cols): b.counts for b in plan[0].buckets}
    assert counts == {(64, 128): [2, 1, 1, 1], (16, 32): [2, 3, 2, 2], (32, 16): [0, 1, 1, 1]}
    world_load = [sum(b.counts[m] * matrix_cost(b.rows, b.cols) for b in plan[0].buckets) for m in range(4)]
    assert max(world_load) - min(world_load) <= matrix_cost(64, 128)
    # the dp groups start from the world's loads: rank 0 (more world work) takes fewer of the 7 matrices
    assert {(b.rows, b.cols): b.counts for b in plan[1].buckets} == {(32, 48): [2, 2], (48, 32): [1, 2]}


def test_one_rank_groups_run_todays_step_bit_for_bit():
    from nagmoe.parallel.distributed_muon import ReplicaGroup, Replication
    from nagmoe.train.optim import Muon

    gen = torch.Generator().manual_seed(5)
    shapes = [(12, 6), (3, 20, 8), (6, 12)]
    start = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(3)]
    names = [f"p{i}" for i in range(len(shapes))]
    plain = [torch.nn.Parameter(w.clone()) for w in start]
    shared = [torch.nn.Parameter(w.clone()) for w in start]
    kw = dict(lr=0.03, momentum=0.9, weight_decay=0.1)
    one = ReplicaGroup((0,), None, "world")
    opt_plain = Muon([dict(params=plain, param_names=names)], **kw)
    opt_shared = Muon([dict(params=shared, param_names=names)], replication=Replication(0, one), **kw)
    for step_grads in grads:
        for a, b, g in zip(plain, shared, step_grads):
            a.grad, b.grad = g.clone(), g.clone()
        opt_plain.step()
        opt_shared.step()
    for a, b in zip(plain, shared):
        assert torch.equal(a, b)
        assert torch.equal(opt_plain.state[a]["momentum_buffer"], opt_shared.state[b]["momentum_buffer"])
    assert opt_shared.sharded.last_matrices == 1 + 3 + 1
    with pytest.raises(ValueError, match="param_names"):
        Muon(plain, replication=Replication(0, one))


def test_one_process_has_no_replication():
    from nagmoe.parallel.distributed_muon import muon_replication, wire_dtype_for
    from nagmoe.parallel.mesh import ParallelMesh

    assert muon_replication(ParallelMesh(), ["blocks.0.ffn.w_in"]) is None
    assert wire_dtype_for(torch.float32, torch.bfloat16) == torch.bfloat16  # CUDA: results travel in bf16
    assert wire_dtype_for(torch.float32, torch.float32) == torch.float32
    assert wire_dtype_for(torch.bfloat16, torch.float32) == torch.bfloat16
