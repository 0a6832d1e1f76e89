"""Seeded, layout-independent initialisation: meta-device construction, then each process draws only the
parameters it holds (issue 25, "meta-device construction"; docs/decisions.md, "seeded initialisation").

Every parameter (every expert of an expert stack separately) is drawn from its own CPU generator seeded by

    stable_seed(seed, name, expert) = first 8 bytes of blake2b(f"{seed}/{name}/{expert}"), 63 bits

with `seed` the run's `train.seed`, `name` the parameter's state-dict key in the unwrapped model
(`blocks.3.ffn.w_in`) and `expert` the GLOBAL expert index of a slice of an expert stack (`-` for any other
parameter). A parameter's values therefore depend on nothing else: not on the EP layout (rank p's local
expert l of a layer is global expert p·L + l and gets exactly that expert's values), not on which other
parameters were drawn first, not on the device (the draw runs on the CPU generator and is copied over).
Python's `hash()` is salted per process, hence the explicit hash.

Flow (`build_model` in transformer.py, the trainer):
    with torch.device("meta"):
        model = Transformer(cfg)              # structure only, no memory
    shard_experts(model, mesh)                # optional: the stacks shrink to this rank's experts (still meta)
    init_model(model, seed, device)           # allocate what is held, draw every parameter, recompute buffers

The distributions are the modules' own: a module of this package initialises its parameters (and those of
its plain `nn.Linear`/`nn.Embedding`/`nn.Conv1d` children) in `init_weights(init: ParamInit)`, through the
`ParamInit` methods below; `reset_parameters()` is `init_weights(ParamInit(None))`, the global-RNG stream a
directly constructed module (`MoELayer(...)`) still uses. Non-parameter state that a fresh module holds
(buffers) is recomputed by `reset_buffers()` after allocation. `init_model` checks that every parameter was
initialised exactly once and that no meta tensor is left.
"""
from __future__ import annotations

import hashlib
import math
from collections import Counter
from typing import Callable, Optional

import torch
from torch import nn

_SEED_MASK = (1 << 63) - 1


def stable_seed(seed: int, name: str, expert: Optional[int] = None) -> int:
    """The generator seed of parameter `name` (expert slice `expert`, global index) under run seed `seed`:
    a stable hash, equal in every process and Python version."""
    key = f"{int(seed)}/{name}/{'-' if expert is None else int(expert)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _SEED_MASK


def generator_for(seed: int, name: str, expert: Optional[int] = None) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(stable_seed(seed, name, expert))


Draw = Callable[[torch.Tensor, Optional[torch.Generator]], object]  # fills its tensor in place


class ParamInit:
    """Draws the parameters of one module: `seed` None = torch's global generator, whole tensors in call
    order (a directly constructed module: the legacy stream); otherwise per-parameter generators
    (`stable_seed`), one per expert for an expert stack. `prefix` is the module's name in the model; `done`
    collects the full names initialised (`init_model` shares one list over all modules)."""

    def __init__(self, seed: Optional[int] = None, prefix: str = "", done: Optional[list] = None):
        self.seed, self.prefix = seed, prefix
        self.done = [] if done is None else done

    def full_name(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    # --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _draw(self, module: nn.Module, name: str, draw: Draw, first_expert: Optional[int]) -> None:
        """Fill `module.<name>` with `draw`; with `first_expert` dim 0 holds experts first_expert, ... (one
        generator each)."""
        tensor = module.get_parameter(name)
        full = self.full_name(name)
        self.done.append(full)
        if tensor.device.type == "meta":  # structure only (construction under torch.device("meta"))
            return
        if self.seed is None:
            draw(tensor, None)
            return
        pieces = ([(tensor, None)] if first_expert is None
                  else [(tensor[i], first_expert + i) for i in range(tensor.shape[0])])
        for piece, expert in pieces:
            generator = generator_for(self.seed, full, expert)
            if piece.device.type == "cpu":
                draw(piece, generator)
            else:  # the CPU stream, whatever the device: same values on every device
                staged = torch.empty(piece.shape, dtype=piece.dtype, device="cpu")
                draw(staged, generator)
                piece.copy_(staged)

    def uniform_(self, module: nn.Module, name: str, bound: float, first_expert: Optional[int] = None) -> None:
        """U(-bound, bound)."""
        self._draw(module, name, lambda t, g: nn.init.uniform_(t, -bound, bound, generator=g), first_expert)

    def normal_(self, module: nn.Module, name: str, std: float, first_expert: Optional[int] = None) -> None:
        """N(0, std²)."""
        self._draw(module, name, lambda t, g: nn.init.normal_(t, std=std, generator=g), first_expert)

    def zeros_(self, module: nn.Module, name: str) -> None:
        self.fill_(module, name, 0.0)

    def fill_(self, module: nn.Module, name: str, value: float) -> None:
        self._draw(module, name, lambda t, g: t.fill_(value), None)

    def conv_default_(self, module: nn.Module, name: str) -> None:
        """PyTorch's default init of the convolution `module.<name>` (nn.Conv1d.reset_parameters, same
        distributions): weight kaiming-uniform with a = sqrt(5), i.e. U(±1/sqrt(fan_in)); bias U(±1/sqrt(fan_in))."""
        conv = module.get_submodule(name)
        if self.seed is None:  # the legacy stream: exactly torch's own call
            if conv.weight.device.type != "meta":
                conv.reset_parameters()
            self.done.extend(self.full_name(f"{name}.{p}") for p, _ in conv.named_parameters(recurse=False))
            return
        self._draw(module, f"{name}.weight",
                   lambda t, g: nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g), None)
        if conv.bias is not None:
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(conv.weight)
            self.uniform_(module, f"{name}.bias", 1 / math.sqrt(fan_in) if fan_in else 0.0)


# ------------------------------------------------------------------------------------------------------------
def init_model(model: nn.Module, seed: int, device=None) -> nn.Module:
    """Materialise `model` (built under torch.device("meta"), possibly with its expert stacks already cut to
    this rank's experts) on `device` (default CPU): allocate exactly the parameters and buffers it holds, draw
    every parameter from its (seed, name, global expert) generator, recompute the buffers. Returns `model`."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "meta":
        raise ValueError("init_model: materialise on a real device, not meta")
    allocate(model, device)
    done: list[str] = []
    for mod_name, module in model.named_modules():
        init_weights = getattr(module, "init_weights", None)
        if init_weights is not None:
            init_weights(ParamInit(seed, mod_name, done))
    for _, module in model.named_modules():
        reset_buffers = getattr(module, "reset_buffers", None)
        if reset_buffers is not None:
            reset_buffers()
    counts = Counter(done)
    missing = sorted(n for n, _ in model.named_parameters() if n not in counts)
    twice = sorted(n for n, c in counts.items() if c > 1)
    if missing or twice:
        raise RuntimeError(f"init_model: parameters without an init_weights draw: {missing}; drawn twice: {twice}")
    left = meta_tensors(model)
    if left:
        raise RuntimeError(f"init_model: still on the meta device after materialisation: {left}")
    return model


def allocate(model: nn.Module, device: torch.device) -> None:
    """Uninitialised storage on `device` for every parameter and buffer of `model` (what `Module.to_empty`
    does, without its meta-tensor `empty_like`, whose first call imports sympy: seconds per process)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                               requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of the parameters, buffers and plain tensor attributes of `model` that are meta tensors."""
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    for mod_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                left.append(f"{mod_name}.{attr}" if mod_name else attr)
    return left
