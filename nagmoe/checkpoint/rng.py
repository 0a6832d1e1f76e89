"""Every RNG a training process draws from, as JSON (stored per rank in state.json, restored by rank index).

Another world size on resume (`restore_rank_rng`): rank r restores the state rank r saved when the checkpoint
has one (so the same world size continues every stream exactly), and otherwise seeds every generator from
(train.seed, step, r) — deterministic, and distinct per rank and per resume step, where reusing rank 0's
state would give two ranks one stream. Nothing in training draws from these generators today (the data order
is a function of data, seed and global batch alone: nagmoe.data.loader), so this only fixes what a future
consumer (dropout, noise) would see.
"""
from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng_state() -> dict:
    """This process's torch (CPU, CUDA if initialised), numpy and python RNG states, JSON-serialisable."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch_cpu": _b64(torch.get_rng_state()),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": version, "words": list(words), "gauss_next": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["words"]), p["gauss_next"]))
    cuda = state.get("torch_cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_unb64(s) for s in cuda])
        else:  # different device count: restore the current device from the first saved state
            torch.cuda.set_rng_state(_unb64(cuda[0]))


def seed_for(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed derived from (seed, step, rank) by numpy's SeedSequence (well mixed, platform independent)."""
    hi, lo = np.random.SeedSequence([int(v) % 2**64 for v in (seed, step, rank)]).generate_state(2, np.uint32).tolist()
    return ((hi & 0x7FFFFFFF) << 32) | lo


def seed_all(value: int) -> None:
    """Seed torch (CPU and every CUDA device), numpy's global and python's generators from `value`."""
    torch.manual_seed(value)  # also seeds every CUDA device
    np.random.seed(value % 2**32)
    random.seed(value)


def restore_rank_rng(states: list, rank: int, seed: int, step: int) -> str:
    """This rank's generators on resume: `states[rank]` when the checkpoint has it, else seeded from
    (seed, step, rank) (module docstring). Returns "restored" or "derived"."""
    if rank < len(states):
        restore_rng_state(states[rank])
        return "restored"
    seed_all(seed_for(seed, step, rank))
    return "derived"
