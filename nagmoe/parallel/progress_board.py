"""Who stopped making progress: every rank's last finished step and host, and a heartbeat, in the rendezvous
store every rank already holds (issue 61). When the progress watchdog or a collective's timeout ends a rank, its
one line names the ranks that fell silent or behind and their hosts, not only the rank that waited:

    ranks 2-3 on n2 silent since step 24 (no heartbeat for 3 s: stopped, hung or cut off); this rank (0 on n1)
    last finished step 25

Each rank's entry `nagmoe/progress/<rank>` = "<step> <heartbeat> <host>" is written by a daemon thread (`start`)
when the main thread finishes a step (it sets an attribute and an event; at most one write per MIN_GAP_S) and
at least once a second: the step and a counter that advances with every write. The step's path gains nothing:
no collective, no host sync, no store round trip on the main thread. A rank whose process is frozen (SIGSTOP),
hung in C with its GIL held, or cut off from the store stops advancing its heartbeat; the reader (`culprits`)
reads every entry twice, `SILENCE_S` apart, and names the ranks whose heartbeat did not move, or else the ranks
whose step is behind the newest. Clocks of different hosts are never compared. A store that does not answer
within `READ_TIMEOUT_S` (the reader is the one cut off, or the store's host is gone) is said so in the line.
Every store call of the reader runs in a helper thread joined with a timeout: a blocked store never keeps a rank
that must end alive.
"""
from __future__ import annotations

import re
import threading
import time
from typing import Callable, Optional

from nagmoe.base.errors import shown

PREFIX = "nagmoe/progress/"
INTERVAL_S = 1.0  # heartbeat period when no step finishes
MIN_GAP_S = 0.05  # at most 20 writes a second per rank, however short the steps
SILENCE_S = 3.0  # a heartbeat that did not move over this long is silent (3 periods)
READ_TIMEOUT_S = 5.0  # a store read that takes longer: the store is unreachable from here
NAMED_GROUPS = 4  # groups of ranks named in the line, then a count


def _bounded(fn: Callable, timeout_s: float):
    """fn() in a daemon thread: (result, None), or (None, why) when it raised or did not return in time."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - any store error is an answer: unreachable
            box["error"] = f"{type(e).__name__}: {shown(str(e), 120)}"

    thread = threading.Thread(target=run, name="nagmoe-progress-read", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, f"no answer within {timeout_s:g} s"
    return box.get("value"), box.get("error")


def parse_entry(raw) -> Optional[tuple[int, int, str]]:
    """(step, heartbeat, host) of a stored entry, None for anything else (a foreign or torn value)."""
    try:
        step, beat, host = bytes(raw).decode("utf-8", "replace").split(" ", 2)
        return int(step), int(beat), host
    except (TypeError, ValueError):
        return None


def host_name(host: str) -> str:
    """A host name as the line shows it: plain when it looks like one, else bounded and quoted (a stored value)."""
    return host if re.fullmatch(r"[A-Za-z0-9._-]{1,64}", host or "") else shown(host, 60)


def rank_groups(ranks: list[int]) -> str:
    """[2, 3, 5] -> "ranks 2-3, 5"; [4] -> "rank 4"."""
    spans, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            spans.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(spans)


class ProgressBoard:
    """See the module docstring. `store`: a torch.distributed Store (the default group's: `default_board`)."""

    def __init__(self, store, rank: int, world_size: int, host: str, interval_s: float = INTERVAL_S):
        self.store, self.rank, self.world_size, self.host = store, rank, world_size, host
        self.interval_s = interval_s
        self.step = 0  # the main thread's last finished step (`step_done`)
        self.beat = 0
        self.last_error: Optional[str] = None  # the last failed write (the store unreachable from here)
        self._stop = threading.Event()
        self._stepped = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def key(self, rank: int) -> str:
        return f"{PREFIX}{rank}"

    # ---------------------------------------------------------------------------------------- the writer
    def step_done(self, step: int) -> None:
        self.step = step  # an attribute write and an event: the heartbeat thread publishes it at once
        self._stepped.set()

    def publish(self) -> None:
        """One write of this rank's entry (the heartbeat thread's, and once at `start`)."""
        self.beat += 1
        self.store.set(self.key(self.rank), f"{self.step} {self.beat} {self.host}")

    def start(self, first_step: int = 0) -> "ProgressBoard":
        self.step = first_step
        self._thread = threading.Thread(target=self._beat, name="nagmoe-progress-board", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        """A write per finished step (at most one per MIN_GAP_S) and at least one per `interval_s`."""
        while not self._stop.is_set():
            self._stepped.clear()
            try:
                self.publish()
                self.last_error = None
            except Exception as e:  # noqa: BLE001 - the store unreachable: try again next period
                self.last_error = f"{type(e).__name__}: {shown(str(e), 120)}"
            self._stepped.wait(self.interval_s)
            self._stop.wait(MIN_GAP_S)

    def stop(self) -> None:
        """No write after this returns (a write in flight is waited for, briefly): a job's end, where the store's
        host may go first, sees no failed write."""
        self._stop.set()
        self._stepped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=READ_TIMEOUT_S)

    # ---------------------------------------------------------------------------------------- the reader
    def read(self) -> tuple[Optional[dict], Optional[str]]:
        """({rank: (step, heartbeat, host) or None when it never wrote}, None) or (None, why unreachable)."""
        def entries():
            keys = [self.key(r) for r in range(self.world_size)]
            present = [self.store.check([k]) for k in keys]
            return {r: parse_entry(self.store.get(k)) if ok else None for r, (k, ok) in enumerate(zip(keys, present))}
        return _bounded(entries, READ_TIMEOUT_S)

    def culprits(self, my_step: int, silence_s: float = SILENCE_S) -> str:
        """The clause a failure line ends with: who is silent or behind, with hosts and steps; or that no rank
        is (then the fault is elsewhere: a file system, this rank itself); or that the store did not answer."""
        first, why = self.read()
        if first is None:
            return f"the rendezvous store did not answer ({why}): this rank may be the one cut off"
        time.sleep(silence_s)
        second, why = self.read()
        if second is None:
            return f"the rendezvous store stopped answering ({why}): this rank may be the one cut off"
        me = f"this rank ({self.rank} on {host_name(self.host)}) last finished step {my_step}"
        never = sorted(r for r in range(self.world_size) if r != self.rank and second.get(r) is None)
        silent = sorted(r for r in range(self.world_size) if r != self.rank and r not in never
                        and first.get(r) is not None and first[r][1] == second[r][1])
        if silent:
            return self._describe(silent, second, f"silent since step {{step}} (no heartbeat for {silence_s:g} s: "
                                                  "stopped, hung or cut off)", never) + "; " + me
        steps = {r: e[0] for r, e in second.items() if e is not None}
        newest = max([my_step, *steps.values()])
        behind = sorted(r for r, s in steps.items() if r != self.rank and s < newest)
        if behind:
            return self._describe(behind, second, "last finished step {step}", never) + "; " + me
        if never:
            return self._describe([], second, "", never) + "; " + me
        return f"every rank answers and none is behind ({me})"

    def _describe(self, ranks: list[int], entries: dict, what: str, never: list[int]) -> str:
        """"ranks 2-3 on n2 <what>" per (host, step) group, bounded, plus the ranks that never wrote."""
        groups: dict = {}
        for r in ranks:
            step, _, host = entries[r]
            groups.setdefault((host, step), []).append(r)
        parts = [f"{rank_groups(rs)} on {host_name(host)} {what.format(step=step)}"
                 for (host, step), rs in sorted(groups.items(), key=lambda kv: kv[1][0])]
        if never:
            parts.append(f"{rank_groups(never)} never reported a step")
        shown_parts = parts[:NAMED_GROUPS]
        more = len(parts) - len(shown_parts)
        return "; ".join(shown_parts) + (f"; and {more} more groups of ranks" if more else "")


def default_board(rank: int, world_size: int, host: str) -> Optional[ProgressBoard]:
    """The board on the default process group's store, or None without a process group (one process) or a
    store (a backend that hides it)."""
    import torch.distributed as dist

    if world_size < 2 or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return ProgressBoard(store, rank, world_size, host)
