"""Host batches onto the device without a stall (issue 39).

`t.to(cuda)` from ordinary (pageable) host memory is synchronous: the host waits for the copy, and the copy
waits behind the work already queued on the stream, so every micro-step's batch drained the GPU's queue. A pinned
source copies asynchronously (`non_blocking=True`): the host queues the copy and goes on. Pinning is CUDA's
(`pin_memory()` raises on a CPU-only torch), so elsewhere this is a plain `to`.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: pinned and non-blocking for a host tensor going to CUDA, otherwise `t.to(device)`. The
    pinned copy comes from torch's caching host allocator, which keeps it until the copy has run."""
    if t.device.type == "cpu" and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
