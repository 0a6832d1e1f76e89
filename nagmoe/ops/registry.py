"""Backend registry for fast paths. Each op has a pure-torch reference (the oracle and the CPU default)
and optional fast implementations that declare whether they can run here. `resolve` picks one, logs the
choice once per (op, name), and warns when a known-slow fallback was taken in place of an asked-for path."""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("nagmoe.backends")


@dataclass(frozen=True)
class Backend:
    name: str
    available: Callable[[], bool]
    slow: bool = False  # a known-slow path: warn when it is resolved on a device that has better


class Registry:
    """Backends of one op, in preference order for `auto`."""

    def __init__(self, op: str, reference: str):
        self.op = op
        self.reference = reference
        self._backends: dict[str, Backend] = {}

    def register(self, name: str, available: Callable[[], bool] = lambda: True, slow: bool = False) -> None:
        self._backends[name] = Backend(name, available, slow)

    def names(self) -> list[str]:
        return list(self._backends)

    def resolve(self, requested: str = "auto") -> str:
        if requested != "auto":
            if requested not in self._backends:
                raise ValueError(f"{self.op}: unknown backend {requested!r} (known: {', '.join(self._backends)})")
            b = self._backends[requested]
            if b.available():
                return requested
            fallback = self.resolve("auto")  # what `auto` would pick, not necessarily the slow reference
            warnings.warn(f"{self.op}: backend {requested!r} is not available here; using {fallback!r}",
                          stacklevel=2)
            return fallback
        for b in self._backends.values():
            if b.available():
                if b.slow:
                    warnings.warn(f"{self.op}: only the slow backend {b.name!r} is available", stacklevel=2)
                return b.name
        return self.reference


def describe(resolved: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(resolved.items()))
