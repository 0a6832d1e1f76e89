"""Gradient synchronisation for DDP + expert parallelism, and the global gradient norm.

Each rank r optimises its share of the global objective: the trainer's loss on r is the mean over its own
tokens (and micro-steps), and the global loss is the mean over the W ranks, L = (1/W) Σ_r L_r.
  * replicated (non-expert) parameters: DDP all-reduces the bucketed gradients and divides by W, giving
    ∂L/∂θ. DDP runs on its own process group and skips accumulation micro-steps (`no_sync`).
  * expert parameters under EP: the all-to-all backward already brings to the owner of expert e the
    gradient from every token of its EP group, Σ_{r in ep group} ∂L_r/∂w_e; the dp group (the ranks holding
    the same experts, one per EP group) sums these, and dividing by W gives ∂L/∂w_e — the same global mean.
    A rank whose experts saw no token has no gradient: it joins with zeros (the single-process optimizer
    also sees a zero gradient for an idle expert of a stack).
  * the clipping norm is global: ||g||² = Σ_replicated g² (identical on every rank after DDP) + the sum
    over the EP group of each rank's expert g² (each expert counted once).
"""
from __future__ import annotations

import inspect
import math
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nagmoe.parallel.mesh import ParallelMesh


def wrap_ddp(model: nn.Module, mesh: ParallelMesh, expert_names: Sequence[str] = ()) -> DistributedDataParallel:
    """DDP over all ranks for every parameter except the (sharded) expert stacks.

    Buffers are not broadcast (the trainer sets them identically on every rank); the parameters are (rank
    0's) at construction, which is a no-op for identically seeded models and checkpoint loads."""
    if expert_names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(expert_names))
    device_ids = [model_device(model).index] if model_device(model).type == "cuda" else None
    # no buffer broadcast before each forward (torch >= 2.13 renames the switch; older: broadcast_buffers)
    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.ddp_group, **no_buffer_sync)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def named_params(model: nn.Module, names: Iterable[str]) -> list[nn.Parameter]:
    table = dict(model.named_parameters())
    return [table[n] for n in names]


@torch.no_grad()
def sync_expert_grads(expert_params: Sequence[nn.Parameter], mesh: ParallelMesh) -> None:
    """grad <- (Σ over the dp group of grad) / W for the expert parameters (zeros where a rank had none)."""
    if not expert_params:
        return
    for p in expert_params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in expert_params]
    if mesh.dp > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for all expert stacks
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=mesh.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    torch._foreach_div_(grads, float(mesh.world_size))


@torch.no_grad()
def clip_grad_norm_(replicated: Sequence[nn.Parameter], experts: Sequence[nn.Parameter], max_norm: float,
                    mesh: ParallelMesh) -> torch.Tensor:
    """Clip all gradients by the global norm (module docstring) like `torch.nn.utils.clip_grad_norm_`
    (coef = max_norm / (norm + 1e-6), at most 1); returns the norm. `max_norm <= 0` means no clipping."""
    rep = [p.grad for p in replicated if p.grad is not None]
    exp = [p.grad for p in experts if p.grad is not None]
    device = (rep or exp)[0].device
    rep_sq = sum((g.float().square().sum() for g in rep), torch.zeros((), device=device))
    exp_sq = sum((g.float().square().sum() for g in exp), torch.zeros((), device=device))
    if experts and mesh.ep > 1:
        dist.all_reduce(exp_sq, op=dist.ReduceOp.SUM, group=mesh.ep_group)
    total = (rep_sq + exp_sq).sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(rep + exp, coef)
    return total
