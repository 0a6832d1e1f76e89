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

Stacked Muon (`impl="stacked"`, train.muon_impl; issue 60): the matrices of one parameter group whose wide
orientation (m, n), m <= n, dtype and device agree form a stack; per stack ONE batched Newton-Schulz on the
(G, m, n) batch (`orthogonalise_stack`) instead of G calls, optionally the whole stack step (momentum,
Newton-Schulz, apply) as one compiled function per stack (`compile=True`, dynamic=False: a stack's shapes never
change; lr enters as a device scalar so the schedule does not recompile). Per matrix the same maths as the loop;
the batch and the fp32 lr scalar round the last bits differently (tests/train/test_muon_stacked.py: rel 1e-6).

Device-side guard (`step(ok=...)`, issue 60): `ok` a device bool (the step's loss and gradient norm finite). The
update is computed, then written only where ok: buf <- where(ok, buf', buf), W <- where(ok, W', W), so the
trainer launches the step before its one metrics read and a non-finite step still changes nothing. AdamW: torch's
fused kernel skips its update on `found_inf` = !ok and takes the step count back (`OptimizerBundle.step`).
"""
from __future__ import annotations

import types
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

# the Newton-Schulz kernel lives in nagmoe/ops/newton_schulz.py (distributed Muon in nagmoe.parallel uses it too)
from nagmoe.ops.newton_schulz import (NS_COEFFS, NS_STEPS, muon_shape_scale, orthogonalise,  # noqa: F401
                                      orthogonalise_stack, wide_shape)
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
MUON_IMPLS = ("auto", "loop", "stacked")  # train.muon_impl
# elements per stack (64 Mi, as distributed Muon's BATCH_ELEMENTS): a longer run of one wide shape is cut at
# parameter boundaries, bounding the step's temporaries (the cat, Newton-Schulz's X, the new weights) to ~1 GiB
STACK_ELEMENTS = 1 << 26
STACK_COMPILE_BACKEND = "inductor"  # the compiled stack step's backend (a test traces with aot_eager: seconds)


def resolve_muon_impl(setting: str, device_type: str) -> str:
    """train.muon_impl for a device type: auto = stacked on CUDA (launch-bound there), loop on the CPU."""
    if setting not in MUON_IMPLS:
        raise ValueError(f"train.muon_impl: {setting!r} is not one of {', '.join(MUON_IMPLS)}")
    return ("stacked" if device_type == "cuda" else "loop") if setting == "auto" else setting


def _stack_step(params, grads, bufs, lr, ok, mu: float, wd: float, nesterov: bool, steps: int, ns_dtype,
                scales) -> None:
    """One stack's Muon step (module docstring): `lr` a 0-d device tensor, `ok` a device bool or None."""
    new_bufs = [b.lerp(g, 1.0 - mu) for b, g in zip(bufs, grads)]  # buf = mu*buf + (1-mu)*g
    updates = [g.lerp(b, mu) for g, b in zip(grads, new_bufs)] if nesterov else new_bufs
    orthos = orthogonalise_stack(updates, steps, ns_dtype)
    for p, b, nb, o, scale in zip(params, bufs, new_bufs, orthos, scales):
        new_p = (p * (1.0 - lr * wd) if wd else p) - (lr * scale) * o
        if ok is not None:
            nb, new_p = torch.where(ok, nb, b), torch.where(ok, new_p, p)
        b.copy_(nb)
        p.copy_(new_p)


def _own_code(fn):
    """A copy of `fn` with its own code object: dynamo's recompile limit (8) counts per code object, so every
    stack's compiled step gets its own and many stacks never push one another back to eager."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalised by Newton-Schulz, for 2-D matrices and batched (3-D) expert stacks.

    Every parameter must have >= 2 dims; which parameters get Muon is decided by role, by the caller.
    `ns_dtype=None` picks bf16 on CUDA and fp32 on CPU.
    `replication` (a `nagmoe.parallel.distributed_muon.Replication`: which ranks hold each parameter, by name;
    every group then needs `param_names`) splits the orthogonalisation over those ranks; None: one process.
    `impl`: loop (one matrix at a time) | stacked (one batched Newton-Schulz per same-shape stack, compiled per
    stack with `compile`); state and checkpoints are the same for both (module docstring).
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = NS_STEPS, ns_dtype: Optional[torch.dtype] = None,
                 replication=None, impl: str = "loop", compile: bool = False):
        if impl not in ("loop", "stacked"):
            raise ValueError(f"Muon: impl {impl!r} is not loop or stacked")
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
        self.impl, self.compile = impl, compile
        self._stacks: dict = {}  # (group index, params with a gradient) -> [(key, indices into the group)]
        self._compiled: dict = {}  # stack key -> its compiled step
        self._lr: dict = {}  # device -> the 0-d lr tensor of the stacked step
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
    def step(self, closure=None, ok: Optional[torch.Tensor] = None):
        """One Muon step; `ok` (a device bool): apply it only where true (module docstring), no host read."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.sharded is not None:
            if ok is not None:
                raise ValueError("distributed Muon has no device-side guard: read the metrics before its step")
            self._step_sharded()
            return loss
        for index, group in enumerate(self.param_groups):
            if self.impl == "stacked":
                self._step_stacked(index, group, ok)
            else:
                self._step_loop(group, ok)
        return loss

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        return state["momentum_buffer"]

    def _step_loop(self, group: dict, ok: Optional[torch.Tensor]) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad, buf = p.grad, self._momentum_buffer(p)
            if ok is None:
                buf.lerp_(grad, 1.0 - mu)  # buf = mu*buf + (1-mu)*g
                update = grad.lerp(buf, mu) if group["nesterov"] else buf  # (1-mu)*g + mu*buf
                ortho = orthogonalise(update, group["ns_steps"], self.ns_dtype)
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.add_(ortho, alpha=-lr * muon_shape_scale(p.shape))
                continue
            # guarded: the same ops out of place (bitwise the same values), written where ok
            new_buf = buf.lerp(grad, 1.0 - mu)
            update = grad.lerp(new_buf, mu) if group["nesterov"] else new_buf
            ortho = orthogonalise(update, group["ns_steps"], self.ns_dtype)
            new_p = p.mul(1.0 - lr * wd) if wd else p.clone()
            new_p.add_(ortho, alpha=-lr * muon_shape_scale(p.shape))
            buf.copy_(torch.where(ok, new_buf, buf))
            p.copy_(torch.where(ok, new_p, p))

    def stacks(self, index: int, group: dict) -> list[tuple[tuple, list[int]]]:
        """Group `index`'s parameters with a gradient as stacks: [(key, indices)]: one wide shape (m, n), dtype
        and device each, in order of first appearance, cut into runs of at most STACK_ELEMENTS elements (a larger
        parameter alone); key = (group index, the members' shapes, dtype, device): equal runs share one compiled
        step. Cached per set of parameters with a gradient."""
        live = tuple(i for i, p in enumerate(group["params"]) if p.grad is not None)
        cached = self._stacks.get(index)
        if cached is None or cached[0] != live:
            by_shape: dict = {}
            for i in live:
                p = group["params"][i]
                by_shape.setdefault((wide_shape(p.shape), p.dtype, str(p.device)), []).append(i)
            runs = []
            for (_, dtype, device), members in by_shape.items():
                run, size = [], 0
                for i in members:
                    n = group["params"][i].numel()
                    if run and size + n > STACK_ELEMENTS:
                        runs.append(run)
                        run, size = [], 0
                    run.append(i)
                    size += n
                runs.append(run)
            stacks = [((index, tuple(tuple(group["params"][i].shape) for i in run), group["params"][run[0]].dtype,
                        str(group["params"][run[0]].device)), run) for run in runs]
            self._stacks[index] = cached = (live, stacks)
        return cached[1]

    def _step_stacked(self, index: int, group: dict, ok: Optional[torch.Tensor]) -> None:
        params = group["params"]
        for key, members in self.stacks(index, group):
            ps = [params[i] for i in members]
            bufs = [self._momentum_buffer(p) for p in ps]
            device = ps[0].device
            if device not in self._lr:
                self._lr[device] = torch.zeros((), dtype=torch.float32, device=device)
            lr = self._lr[device]
            lr.fill_(group["lr"])  # a device fill, no host wait; the compiled step never sees a new constant
            step = _stack_step
            if self.compile:
                if key not in self._compiled:
                    # fullgraph: a host read in the step would fail the compile, not break the graph
                    self._compiled[key] = torch.compile(_own_code(_stack_step), dynamic=False, fullgraph=True,
                                                        backend=STACK_COMPILE_BACKEND)
                step = self._compiled[key]
            step(ps, [p.grad for p in ps], bufs, lr, ok, group["momentum"], group["weight_decay"],
                 group["nesterov"], group["ns_steps"], self.ns_dtype, [muon_shape_scale(p.shape) for p in ps])

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

    @property
    def device_guard(self) -> bool:
        """Whether `step(ok=...)` is available: every optimizer a one-process Muon or a torch AdamW."""
        return all((isinstance(o, Muon) and o.sharded is None) or type(o) is torch.optim.AdamW
                   for o in self.optimizers)

    def step(self, ok: Optional[torch.Tensor] = None) -> None:
        """Every optimizer's step; with `ok` (a device bool) the step is applied only where ok is true (the
        non-finite guard decided on the device: nothing reaches weights or state otherwise, no host read)."""
        if ok is None:
            for opt in self.optimizers:
                opt.step()
            return
        if not self.device_guard:
            raise ValueError("OptimizerBundle.step(ok=...): only one-process Muon and torch AdamW take a device guard")
        found_inf = (~ok).to(torch.float32)  # GradScaler's protocol: 1.0 = skip this step
        for opt in self.optimizers:
            if isinstance(opt, Muon):
                opt.step(ok=ok)
            else:
                adamw_step_unless(opt, found_inf)

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


def adamw_step_unless(opt: torch.optim.AdamW, found_inf: torch.Tensor) -> None:
    """`opt.step()` through torch's fused AdamW kernel, which skips the update where the float `found_inf` (0-d,
    on the device) is 1 and then subtracts it from every step count (torch/optim/adam.py `_fused_adam`: steps
    += 1, kernel, steps -= found_inf), as torch.amp.GradScaler drives it. The groups' `fused` flag is set for
    this call only (checkpoints keep the flag they had); the step counts move to the parameters' device first,
    as the fused kernel requires (value unchanged). Fused and unfused AdamW round differently (~1 ulp)."""
    flags = [g["fused"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["fused"] = True
        for p in g["params"]:
            step = opt.state.get(p, {}).get("step")
            if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                opt.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)
    opt.grad_scale, opt.found_inf = None, found_inf
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf
        for g, flag in zip(opt.param_groups, flags):
            g["fused"] = flag


def _named_trainable_params(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    return ((n, p) for n, p in model.named_parameters() if p.requires_grad)


def build_optimizers(model: nn.Module, train_cfg, ns_dtype: Optional[torch.dtype] = None,
                     replication=None) -> OptimizerBundle:
    """Muon for role `matrix`, AdamW (one group per role) for the others; see the module docstring.

    `train_cfg` is a `TrainConfig` (or anything with its lr_*/muon_momentum/weight_decay fields).
    Pass the bare model (not a DDP wrapper), so parameter names match checkpoints and role tables.
    `replication`: who holds which parameter under data/expert parallelism, for distributed Muon
    (`nagmoe.parallel.distributed_muon.muon_replication(mesh, expert_names)`); None for one process.
    Muon's `impl` is `train_cfg.muon_impl` for the matrices' device (auto: stacked on CUDA, loop on the CPU),
    its stacks compiled when `train_cfg.compile` resolves on there; distributed Muon keeps its own split.
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
        from nagmoe.train.speed import resolve_compile

        device_type = by_role[MATRIX][0][1].device.type
        impl = resolve_muon_impl(train_cfg.muon_impl, device_type)
        compile_stack = impl == "stacked" and resolve_compile(train_cfg.compile, device_type)
        optimizers["muon"] = Muon([group(MATRIX)], momentum=train_cfg.muon_momentum,
                                  weight_decay=train_cfg.weight_decay, ns_dtype=ns_dtype,
                                  replication=replication, impl=impl, compile=compile_stack)
    adam_groups = [group(r) for r in ADAMW_ROLES if by_role[r]]
    if adam_groups:
        optimizers["adamw"] = torch.optim.AdamW(adam_groups, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=0.0)
    if not optimizers:
        raise ValueError("build_optimizers: the model has no trainable parameters")
    return OptimizerBundle(optimizers)
