"""Expert parallelism: each EP rank holds E/P experts; tokens travel to them and back by all-to-all.

Shape legend: S = this rank's routing slots sorted by (global) expert, D = model width, E = experts,
P = EP group size, L = E/P local experts, R = slots received by this rank (from all P sources).

`AllToAllDispatcher(layer, x_SD, counts_E) -> y_SD` replaces `MoELayer.run_experts` (via the layer's
`dispatcher` hook), so routing, aux losses and the combine stay in the single-device model. x_SD may be longer
than Σ counts_E (static MoD: the skipped tokens' slots sorted last): only the leading n = Σ_e counts_E rows
travel, sliced with the split sizes read in step 1 (n = Σ_p send_sizes[p], no further host read), and y_SD has
x_SD's rows, the tail 0 (fixed shapes for the compiled unit around the call):
  1. counts   send_PL = counts_E.view(P, L) (slots for EP rank p's expert l); an all-to-all of these counts
              gives recv_PL[q, l] = slots that source q sends to my local expert l.
  2. tokens   x_RD = all_to_all(x_SD) with uneven splits (send_PL.sum(1) out, recv_PL.sum(1) in), autograd
              on (the backward is the reverse all-to-all). Arrives grouped by source, then local expert.
  3. experts  a stable sort by local expert groups the rows expert-major (source order kept within an
              expert, i.e. global token order when ranks hold consecutive token shards), then the same
              grouped kernel as one process: y = relu(x @ w_in[l])² @ w_out[l].
  4. combine  un-sort, reverse all-to-all back to the source ranks: y_SD in the order of x_SD.
A rank that receives no slot still joins both all-to-alls (forward and backward): its empty expert output
is tied to the received tensor by autograd (`x_RD * 0`), so the backward all-to-all runs on every rank.

Experts are sharded by `shard_experts(model, mesh)`, normally on the meta-device structure before anything is
allocated: the trainer builds under `torch.device("meta")`, shards, then `nagmoe.model.init_rng.init_model`
materialises this rank's parameters only, each expert drawn from its (seed, name, global expert) generator,
so rank p's slice is exactly experts [p·L, (p+1)·L) of the single-process initialisation. A materialised
model (tests, tools) is sliced instead.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

from nagmoe.cuda_rules.contracts import payload_dtypes_agree
from nagmoe.model.moe import MoELayer
from nagmoe.ops.grouped_experts import EXPERT_FORWARD, expert_compute_dtype, expert_path
from nagmoe.parallel.mesh import ParallelMesh

EXPERT_PARAMS = ("w_in", "w_out")


class AllToAllDispatcher:
    """The expert-parallel `MoELayer.dispatcher` for one EP group (see the module docstring)."""

    def __init__(self, group, ep_size: int, ep_rank: int, n_experts: int):
        if n_experts % ep_size:
            raise ValueError(f"{n_experts} experts do not split over {ep_size} EP ranks")
        self.group, self.ep_size, self.ep_rank = group, ep_size, ep_rank
        self.n_experts, self.n_local = n_experts, n_experts // ep_size
        # this rank's all-to-all traffic since the last `take_traffic()`: training forwards only (the backward
        # mirrors them; evaluation and guard re-runs under no_grad are left out), python ints from the split
        # sizes already read, so counting costs no sync
        self.traffic = {"calls": 0, "sent": 0, "received": 0}
        # debug: before each token all-to-all, check that every rank ships one dtype (two small all-reduces);
        # the Trainer turns it on under CUDA's rules on the CPU (NAGMOE_CUDA_RULES)
        self.check_payload_dtypes = False

    def take_traffic(self) -> dict:
        """{"calls", "sent", "received"} rows since the last call (tools/bench/bench_ep_imbalance.py), then reset."""
        out, self.traffic = self.traffic, {"calls": 0, "sent": 0, "received": 0}
        return out

    def __repr__(self) -> str:
        return f"AllToAllDispatcher(ep={self.ep_size}, ep_rank={self.ep_rank}, local_experts={self.n_local})"

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """recv_PL[q, l]: slots source rank q sends to my local expert l."""
        send_E = counts_E.to(torch.int64).contiguous()
        recv_E = torch.empty_like(send_E)
        dist.all_to_all_single(recv_E, send_E, group=self.group)  # L counts to each rank, evenly split
        return recv_E.view(self.ep_size, self.n_local)

    def __call__(self, layer: MoELayer, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        P, L = self.ep_size, self.n_local
        if counts_E.numel() != self.n_experts or layer.w_in.shape[0] != L:
            raise RuntimeError(f"{self}: layer has {layer.w_in.shape[0]} local experts and {counts_E.numel()} "
                               "routing counts; shard it with nagmoe.parallel.shard_experts")
        # 1. counts
        recv_PL = self.exchange_counts(counts_E)
        # the layer's one host read (issue 26's EP budget): the all-to-all split sizes, both directions
        send_sizes, recv_sizes = torch.stack([counts_E.view(P, L).sum(1).to(recv_PL.device),
                                              recv_PL.sum(1)]).tolist()
        layer.received_rows = sum(recv_sizes)  # the router telemetry's receive peak (already a host int)
        # ... and as a device fill for the layer's statistics: the compiled unit reads a tensor, not an int (whose
        # value it would guard on: a recompile per distinct count)
        layer.received_rows_stat = torch.full((), layer.received_rows, dtype=torch.float64, device=x_SD.device)
        if torch.is_grad_enabled():
            self.traffic["calls"] += 1
            self.traffic["sent"] += sum(send_sizes)
            self.traffic["received"] += sum(recv_sizes)
        # 2. tokens out: the leading n = Σ send_sizes rows (static MoD's tail of skipped slots stays here)
        n_send, n_rows = sum(send_sizes), x_SD.shape[0]
        x_nD = x_SD[:n_send] if n_send < n_rows else x_SD
        if self.check_payload_dtypes:
            payload_dtypes_agree(x_nD, self.group)
        x_RD = funcol.all_to_all_single_autograd(x_nD.contiguous(), recv_sizes, send_sizes, self.group)
        # 3. local experts, rows grouped expert-major
        local_expert_R = torch.repeat_interleave(
            torch.arange(L, device=x_SD.device).repeat(P), recv_PL.reshape(-1).to(x_SD.device),
            output_size=sum(recv_sizes))
        order_R = torch.argsort(local_expert_R, stable=True)
        counts_L = recv_PL.sum(0).to(counts_E.device)
        layer.ran["experts"] = expert_path(layer.backend, x_RD, layer.w_in) + " (expert-parallel)"
        if x_RD.shape[0] == 0:  # nothing to compute, but keep the graph so the backward all-to-all runs; in the
            # experts' compute dtype: the return all-to-all sizes its buffers by each rank's own dtype, so an fp32
            # empty rank among bf16 ones would give the others garbage rows, not an error
            y_RD = x_RD.to(expert_compute_dtype(x_RD)) * 0.0
        else:
            y_sorted = EXPERT_FORWARD[layer.backend](x_RD[order_R], layer.w_in, layer.w_out, counts_L)
            unsort_R = torch.empty_like(order_R)
            unsort_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
            y_RD = y_sorted[unsort_R]
        # 4. results back to the sources, in the order of x_SD; a tail that did not travel gets 0 rows (the layer
        # masks it anyway), so y_SD has x_SD's shape whatever n is. Always a plain tensor, waited on here (its
        # first use follows at once): funcol returns an AsyncCollectiveTensor, `cat` a Tensor, and a compiled
        # unit resuming after this call guards on the type (a recompile at the skip start)
        if self.check_payload_dtypes:
            payload_dtypes_agree(y_RD, self.group)
        y_nD = funcol.wait_tensor(funcol.all_to_all_single_autograd(y_RD.contiguous(), send_sizes, recv_sizes,
                                                                    self.group))
        if n_send == n_rows:
            return y_nD
        return torch.cat([y_nD, y_nD.new_zeros(n_rows - n_send, y_nD.shape[1])])


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]


def shard_experts(model: nn.Module, mesh: ParallelMesh) -> list[str]:
    """Keep this EP rank's slice of every expert stack (`MoELayer.keep_experts`: on a meta-device model
    nothing is allocated), install the all-to-all dispatcher, and return the names of the sharded (expert)
    parameters. A no-op returning [] when `mesh.ep == 1`."""
    if mesh.ep == 1:
        return []
    names = []
    for mod_name, layer in moe_layers(model):
        if layer.dispatcher is not None:
            raise RuntimeError(f"{mod_name}: experts are already sharded")
        dispatcher = AllToAllDispatcher(mesh.ep_group, mesh.ep, mesh.ep_rank, layer.n_experts)  # checks E % P
        layer.keep_experts(mesh.ep_rank * dispatcher.n_local, dispatcher.n_local)
        names.extend(f"{mod_name}.{p_name}" if mod_name else p_name for p_name in EXPERT_PARAMS)
        layer.dispatcher = dispatcher
    return names


def expert_shard_plan(mesh: ParallelMesh, expert_names: list[str]) -> Optional[dict]:
    """For checkpoints: parameter name -> (DeviceMesh, placements) of the expert stacks, which are sharded
    over the mesh's ep dim (dim 0, experts) and replicated over dp. None when nothing is sharded."""
    if not expert_names:
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = (Replicate(), Shard(0))
    return {name: (mesh.device_mesh, placements) for name in expert_names}
