"""Optimizer groups by parameter role: Muon for weight matrices, AdamW for everything else.

Roles come from `nagmoe.model.roles.param_roles(model)` (decided by what a parameter *is*, never by ndim):

    role          optimizer  LR field (TrainConfig)   notes
    matrix        Muon       lr_matrix                momentum muon_momentum, Nesterov, weight_decay
    embedding     AdamW      lr_embed
    unembedding   AdamW      lr_unembed
    scalar, conv  AdamW      lr_scalar
    router        AdamW      lr_router
    gate          AdamW      lr_gate                  NAG gates/alpha/MoD base: the low LR fixes gate collapse

All AdamW groups use betas (0.8, 0.95), eps 1e-10 and no weight decay (nanochat's settings; the gate
recipe of reference/nag.md). LRs are the raw config values (no width scaling). Every group carries
`role`, `param_names` and `initial_lr`; the schedule sets `lr = initial_lr * multiplier`.

Muon (Keller Jordan's recipe, our implementation): per matrix G (last two dims; leading dims are a batch,
so a 3-D expert stack (E, a, b) is E independent matrices)
    buf    <- mu * buf + (1 - mu) * g                  (momentum, an EMA of gradients)
    update <- (1 - mu) * g + mu * buf                  (Nesterov look-ahead; plain: update = buf)
    O      <- NS5(update) ~= U V^T of update = U S V^T (quintic Newton-Schulz, 5 steps)
    W      <- W * (1 - lr * wd) - lr * sqrt(max(1, rows / cols)) * O

Distributed Muon (`replication=`, nagmoe.parallel.distributed_muon): the ranks that replicate a matrix split
its Newton-Schulz work (whole world for replicated parameters, the dp group for expert shards) and exchange
the results, so every rank applies the same update; momentum stays replicated (checkpoints unchanged). The
trainer passes `muon_replication(mesh, expert_names)`; without it (one process) the step is exactly the above.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch
from torch import nn

# the Newton-Schulz kernel lives in nagmoe/ops/newton_schulz.py (distributed Muon in nagmoe.parallel uses it too)
from nagmoe.ops.newton_schulz import NS_COEFFS, NS_STEPS, muon_shape_scale, orthogonalise  # noqa: F401 (re-exported)
from nagmoe.model.roles import CONV, EMBEDDING, GATE, MATRIX, ROLES, ROUTER, SCALAR, UNEMBEDDING, param_roles

ADAMW_BETAS = (0.8, 0.95)
ADAMW_EPS = 1e-10

ROLE_LR_FIELD = {
    MATRIX: "lr_matrix",
    EMBEDDING: "lr_embed",
    UNEMBEDDING: "lr_unembed",
    SCALAR: "lr_scalar",
    CONV: "lr_scalar",
    ROUTER: "lr_router",
    GATE: "lr_gate",
}
ADAMW_ROLES = (EMBEDDING, UNEMBEDDING, SCALAR, CONV, ROUTER, GATE)


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalised by Newton-Schulz, for 2-D matrices and batched (3-D) expert stacks.

    Every parameter must have >= 2 dims; which parameters get Muon is decided by role, by the caller.
    `ns_dtype=None` picks bf16 on CUDA and fp32 on CPU.
    `replication` (a `nagmoe.parallel.distributed_muon.Replication`: which ranks hold each parameter, by name;
    every group then needs `param_names`) splits the orthogonalisation over those ranks; None: one process.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = NS_STEPS, ns_dtype: Optional[torch.dtype] = None,
                 replication=None):
        if lr < 0 or not 0.0 <= momentum < 1.0 or weight_decay < 0 or ns_steps < 1:
            raise ValueError(f"Muon: bad hyper-parameters lr={lr} momentum={momentum} "
                             f"weight_decay={weight_decay} ns_steps={ns_steps}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps)
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon got a parameter of shape {tuple(p.shape)}; it needs matrices")
        self.replication = replication
        self.sharded = None  # the distributed step (nagmoe.parallel.distributed_muon), when replicated
        if replication is not None:
            from nagmoe.parallel.distributed_muon import ShardedOrthogonaliser

            for group in self.param_groups:
                names = group.get("param_names")
                if names is None or len(names) != len(group["params"]):
                    raise ValueError("Muon with a replication needs `param_names` in every parameter group")
            self.sharded = ShardedOrthogonaliser(replication, ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.sharded is not None:
            self._step_sharded()
            return loss
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1.0 - mu)  # buf = mu*buf + (1-mu)*g
                update = grad.lerp(buf, mu) if group["nesterov"] else buf  # (1-mu)*g + mu*buf
                ortho = orthogonalise(update, group["ns_steps"], self.ns_dtype)
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(ortho, alpha=-lr * muon_shape_scale(p.shape))
        return loss

    def _step_sharded(self) -> None:
        """Momentum for every matrix here (replicated state), then the shared orthogonalise-and-apply."""
        from nagmoe.parallel.distributed_muon import MuonWork

        work = []
        for group in self.param_groups:
            for p, name in zip(group["params"], group["param_names"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1.0 - group["momentum"])
                work.append(MuonWork(p, name, p.grad, buf, group["lr"], group["momentum"], group["nesterov"],
                                     group["weight_decay"], group["ns_steps"]))
        self.sharded.step(work)


class OptimizerBundle:
    """The run's optimizers (Muon for matrices, AdamW for the rest) driven as one.

    Iterating yields the torch optimizers, so `torch.distributed.checkpoint.state_dict` helpers accept it.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.by_kind = dict(optimizers)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.by_kind.values())

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.by_kind)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def set_lr_multiplier(self, multiplier: float) -> None:
        """lr = initial_lr * multiplier in every group (the schedule's output)."""
        for group in self.param_groups:
            group["lr"] = group["initial_lr"] * multiplier

    def state_dict(self) -> dict:
        return {kind: opt.state_dict() for kind, opt in self.by_kind.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.by_kind):
            raise ValueError(f"optimizer state has {sorted(state)}, this bundle has {sorted(self.by_kind)}")
        for kind, opt in self.by_kind.items():
            opt.load_state_dict(state[kind])

    def muon_param_names(self) -> list[str]:
        muon = self.by_kind.get("muon")
        return [] if muon is None else [n for g in muon.param_groups for n in g["param_names"]]

    def param_names_by_role(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for group in self.param_groups:
            out.setdefault(group["role"], []).extend(group["param_names"])
        return out

    def describe(self) -> list[str]:
        """One line per group, for the run log: kind, role, tensors, parameters, initial LR."""
        lines = []
        for kind, opt in self.by_kind.items():
            for g in opt.param_groups:
                n = sum(p.numel() for p in g["params"])
                lines.append(f"{kind:5s} {g['role']:11s} tensors={len(g['params']):4d} params={n:,} "
                             f"lr={g['initial_lr']:g}")
        return lines


def _named_trainable_params(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in model.named_parameters() if p.requires_grad)


def build_optimizers(model: nn.Module, train_cfg, ns_dtype: Optional[torch.dtype] = None,
                     replication=None) -> OptimizerBundle:
    """Muon for role `matrix`, AdamW (one group per role) for the others; see the module docstring.

    `train_cfg` is a `TrainConfig` (or anything with its lr_*/muon_momentum/weight_decay fields).
    Pass the bare model (not a DDP wrapper), so parameter names match checkpoints and role tables.
    `replication`: who holds which parameter under data/expert parallelism, for distributed Muon
    (`nagmoe.parallel.distributed_muon.muon_replication(mesh, expert_names)`); None for one process.
    """
    roles = param_roles(model)
    by_role: dict[str, list[tuple[str, nn.Parameter]]] = {r: [] for r in ROLES}
    for name, p in _named_trainable_params(model):
        if name not in roles:  # a shared parameter first seen under another module's name
            raise ValueError(f"parameter {name} has no role (param_roles did not list it)")
        by_role[roles[name]].append((name, p))

    def group(role: str, **extra) -> dict:
        lr = float(getattr(train_cfg, ROLE_LR_FIELD[role]))
        named = by_role[role]
        return dict(params=[p for _, p in named], param_names=[n for n, _ in named], role=role,
                    lr=lr, initial_lr=lr, **extra)

    optimizers: dict[str, torch.optim.Optimizer] = {}
    if by_role[MATRIX]:
        optimizers["muon"] = Muon([group(MATRIX)], momentum=train_cfg.muon_momentum,
                                  weight_decay=train_cfg.weight_decay, ns_dtype=ns_dtype,
                                  replication=replication)
    adam_groups = [group(r) for r in ADAMW_ROLES if by_role[r]]
    if adam_groups:
        optimizers["adamw"] = torch.optim.AdamW(adam_groups, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0)
    if not optimizers:
        raise ValueError("build_optimizers: the model has no trainable parameters")
    return OptimizerBundle(optimizers)
