"""What the gpu_check processes share (tools/gpu_check/gpu_check.sh): bench.json, the store every section writes its
result into (an atomic rewrite, so a killed section leaves the others' results), the section context and small
helpers. tools/gpu_check/gpu_check_sections.py (the driver and the short sections) and
tools/gpu_check/gpu_check_train.py (the training sections) both import this file; neither imports the other at
import time.
"""
from __future__ import annotations

import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
# tools/bench/ beside this folder on the path: the profile and mod_speed sections import its step_profile
BENCH_TOOLS = os.path.join(REPO, "tools", "bench")
if BENCH_TOOLS not in sys.path:
    sys.path.append(BENCH_TOOLS)
BENCH = "bench.json"
OPEN = (None, "running")  # statuses `record` may replace


class SectionFailed(Exception):
    """A section that has results to keep and still failed (e.g. one training config of three)."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


# ----------------------------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------------------------
def load(out: str) -> dict:
    try:
        with open(os.path.join(out, BENCH)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"sections": {}}


def save(out: str, data: dict) -> None:
    path = os.path.join(out, BENCH)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False, default=str)
        f.write("\n")
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


def put(out: str, name: str, entry: dict, only_open: bool = False) -> bool:
    data = load(out)
    old = data["sections"].get(name, {})
    if only_open and old.get("status") not in OPEN:
        return False
    data["sections"][name] = entry
    save(out, data)
    return True


def finite(value):
    """Strict JSON: NaN/inf become None (loss lists keep their length)."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


class Ctx:
    """What a section gets: the mode, the results folder, a scratch folder, its time limit (the shell kills it
    there; None when run by hand), and `partial` to keep results written so far should it be killed later. A
    partial keeps what the section's entry held (the limit, a compile error) beside the newest result."""

    def __init__(self, name: str, mode: str, out: str, work: str, limit=None, eager: bool = False):
        self.name, self.mode, self.out, self.work, self.t0 = name, mode, out, work, time.time()
        self.limit, self.eager = limit, eager  # eager: this process is a training section's eager fallback
        if eager and os.environ.get("GPU_CHECK_T0"):  # the section's clock and limit started in its first process
            self.t0 = float(os.environ["GPU_CHECK_T0"])

    def seconds_left(self):
        return None if self.limit is None else self.limit - (time.time() - self.t0)

    def note_machine(self, **info) -> None:
        data = load(self.out)
        data.setdefault("machine", {}).update(info)
        save(self.out, data)

    def partial(self, result: dict) -> None:
        old = load(self.out)["sections"].get(self.name, {})
        kept = {k: v for k, v in old.get("result", {}).items() if k not in result} if old.get("result") else {}
        put(self.out, self.name, {"status": "running", "seconds": round(time.time() - self.t0, 1),
                                  "limit": self.limit, "result": finite({**kept, **result})})
