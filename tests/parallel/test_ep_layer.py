"""The expert-parallel MoE layer equals the single-process layer (outputs, aux loss, every gradient, fp32
1e-5) on 4 real gloo ranks: EP=4 (dp=1) and EP=2 (dp=2, experts replicated over two EP groups), for random
routing, an expert that gets no token, and every token to one expert (with top-1 most ranks then receive no
token at all and still join both all-to-alls)."""
import pytest
import torch

from gloo_ranks import run_on_ranks

pytestmark = pytest.mark.distributed

E, D, H, T = 8, 32, 32, 16  # experts, width, expert hidden, tokens per rank row
CASES = [("random", 2), ("empty_expert", 2), ("one_expert_all", 2), ("one_expert_all", 1)]
TOL = 1e-5


def make_layer(K):
    from nagmoe.config import MoEConfig
    from nagmoe.model.moe import MoELayer

    torch.manual_seed(0)
    layer = MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=H, impl="grouped",
                                  lb_loss_weight=0.01, z_loss_weight=0.001))
    with torch.no_grad():  # w_out starts at zero: give it values so every gradient is non-trivial
        layer.w_out.normal_(0.0, H ** -0.5)
    return layer


def routed_input(layer, case, rows):
    """x (rows, T, D); forces routing through a constant feature x[..., 0] = 1 and the router column 0."""
    x = torch.randn(rows, T, D, generator=torch.Generator().manual_seed(1))
    if case == "random":
        return x
    x[..., 0] = 1.0
    with torch.no_grad():
        layer.router.weight[:, 0] = 0.0
        if case == "empty_expert":
            layer.router.weight[0, 0] = -20.0  # expert 0 never chosen
        else:
            layer.router.weight[3, 0] = 20.0  # expert 3 chosen by every token
    return x


def forward_backward(layer, x, g, aux_rows=None):
    """loss = Σ y·g + aux; the reference passes `aux_rows`: then aux is the sum of the per-rank-row aux
    losses (as in the distributed run, where each rank's aux loss is a statistic of its own tokens)."""
    x = x.clone().requires_grad_(True)
    y, aux = layer(x)
    if aux_rows is not None:
        aux = sum(layer(x[r:r + 1])[1] for r in range(aux_rows))
    ((y * g).sum() + aux).backward()
    return y.detach(), aux.detach(), x.grad, {n: None if p.grad is None else p.grad.clone()
                                       for n, p in layer.named_parameters()}


def ep_vs_single(ep):
    """On every rank: the single-process reference on the global batch (one row per rank) vs this rank's
    EP layer on its row. Returns {case: max abs error} and the per-rank receive counts."""
    import torch.distributed as dist

    from nagmoe.config import Config
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.grad_sync import sync_expert_grads
    from nagmoe.parallel.mesh import ParallelMesh

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = Config()
    cfg.model.ffn, cfg.model.moe.n_experts, cfg.parallel.ep = "moe", E, ep
    mesh = ParallelMesh.build(cfg, rank, W)
    errors, received = {}, {}
    for case, K in CASES:
        ref = make_layer(K)
        x = routed_input(ref, case, W)
        g = torch.randn(W, T, D, generator=torch.Generator().manual_seed(2))
        # reference: the global batch in one process; loss = Σ_r L_r, so the trainer's mean over ranks
        # (L / W) has gradients ref / W for the parameters
        aux_ref = ref(x[rank:rank + 1])[1].detach()  # the aux loss is per rank (micro-batch statistics)
        y_ref, _, xg_ref, pg_ref = forward_backward(ref, x, g, aux_rows=W)
        with torch.no_grad():
            ref(x)
        counts = ref.last_stats["tokens_per_expert"]  # routing of the global batch

        layer = make_layer(K)
        layer.load_state_dict(ref.state_dict())
        names = shard_experts(layer, mesh)
        y, aux, xg, pg = forward_backward(layer, x[rank:rank + 1], g[rank:rank + 1])
        experts = [p for n, p in layer.named_parameters() if n in names]
        sync_expert_grads(experts, mesh)
        pg.update({n: p.grad for n, p in layer.named_parameters() if n in names})
        router = pg["router.weight"]
        dist.all_reduce(router)  # what DDP does for replicated parameters: the mean over ranks
        router /= W

        L, lo = E // ep, mesh.ep_rank * (E // ep)
        parts = ((y - y_ref[rank:rank + 1]).abs().max().item(),
                 (aux - aux_ref).abs().item(),
                 (xg - xg_ref[rank:rank + 1]).abs().max().item(),
                 (router - pg_ref["router.weight"] / W).abs().max().item(),
                 *[(pg[n] - pg_ref[n][lo:lo + L] / W).abs().max().item() for n in ("w_in", "w_out")])
        err = max(parts)
        assert layer.w_in.shape[0] == L
        errors[f"{case}/k{K}"] = err
        received[f"{case}/k{K}"] = (int(counts[lo:lo + L].sum()), counts.tolist())
    return errors, received


@pytest.fixture(scope="module")
def results_4_ranks():
    def run(ep, style):
        return run_on_ranks(ep_vs_single, 4, ep, style=style)

    return {4: run(4, "torchrun"), 2: run(2, "slurm")}  # EP=2 through the Slurm-variable init path


@pytest.mark.parametrize("ep", [4, 2])
def test_ep_layer_equals_single_process(results_4_ranks, ep):
    for rank, (errors, _) in enumerate(results_4_ranks[ep]):
        for case, err in errors.items():
            assert err <= TOL, f"ep={ep} rank {rank} {case}: max error {err:.2e}"


def test_edge_cases_really_happen(results_4_ranks):
    _, received = results_4_ranks[4][0]
    assert received["empty_expert/k2"][1][0] == 0  # expert 0 got no token
    assert received["one_expert_all/k1"][1][3] == 4 * T  # every token to expert 3 (owned by rank 1 at ep=4)
    per_rank = [r[1]["one_expert_all/k1"][0] for r in results_4_ranks[4]]
    assert per_rank == [0, 4 * T, 0, 0]  # three ranks received no slot at all
