"""Count the collective calls a piece of training makes, per call site in our code (issue 43: the expert bias adds
none, global-batch balancing one per micro-step). The counterpart of nagmoe/train/sync_count.py for the network:
`with CollectiveCounter() as c: ...` patches the torch.distributed collectives for its duration (no process group
is touched: the calls go through unchanged) and records "path:line name" of the innermost frame under nagmoe/.
Objects that hold a collective function themselves (DDP's reducer, DCP) are not seen: this counts the calls our
code makes."""
from __future__ import annotations

import collections
import functools

import torch.distributed as dist

from nagmoe.train.sync_count import _call_site

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "reduce_scatter", "reduce_scatter_tensor",
               "barrier", "gather", "scatter", "reduce")


class CollectiveCounter:
    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self._saved: dict = {}

    def __enter__(self) -> "CollectiveCounter":
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            @functools.wraps(original)
            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[f"{_call_site()} {_name}"] += 1
                return _original(*args, **kwargs)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def table(self) -> str:
        return "\n".join(f"{n:4d}  {site}" for site, n in self.counts.most_common())
