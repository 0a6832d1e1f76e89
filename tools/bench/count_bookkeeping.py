"""Count the host bookkeeping between training steps on 2 real gloo ranks (issue 67, item 1): collectives and
run-dir path calls per step and rank, by class and call site.

    python tools/bench/count_bookkeeping.py [--ep 1 2] [--steps 10 40] [--config CONFIG] [KEY=VALUE ...]
        [--data-dir DIR --corpus FILE] [--top 8] [--json FILE]

For each `parallel.ep` asked for, the trainer runs twice on 2 gloo ranks (tests/support/gloo_ranks.py), S steps
and L steps (`--steps S L`, default 10 and 40; `train.schedule_steps=L` in both, so the short run is the long
one's beginning), `log.every=10`, `train.hang_timeout_s=0` (no watchdog thread), one torch/OMP thread per rank.
Without `--config`: configs/tiny.yaml with tests/conftest.py's MICRO_OVERRIDES on a micro data set prepared
here (60 Shakespeare scenes, vocab 512) or on `--data-dir`/`--corpus`. Inside each rank, from the Trainer's
construction to the end of `run()`, this tool wraps

  * torch.distributed's collectives (the `torch.distributed` and `distributed_c10d` names: all_reduce,
    broadcast, all_gather*, reduce_scatter*, all_to_all*, gather, scatter, reduce, barrier and the *_object
    ones; a collective made by another wrapped one counts once) and the functional collectives
    (`_functional_collectives`, the EP exchange), each call recorded with its caller: the innermost stack frame
    inside nagmoe/ (file:line function) and up to 4 nagmoe frames outward. The classes:
        ep_exchange         a frame in nagmoe/parallel/expert_parallel.py
        grad_reduction      a frame in nagmoe/parallel/grad_sync.py (or torch's DDP module)
        distributed_muon    a frame in nagmoe/parallel/distributed_muon.py
        expert_bias_counts  RouterAccounting.end_step when model.moe.expert_bias is on (the bias's global counts)
        bookkeeping         everything else
  * the path calls on paths inside the run dir: os.stat and os.lstat (os.path.exists/isfile/isdir/getmtime and
    pathlib go through them), builtins.open/io.open and os.open, os.listdir and os.scandir; kinds stat, open,
    listdir.

Counts of the main thread are the figures; other threads' (the lease refresher rewrites lease.json every few
seconds, whatever the step count) are shown apart as `background`. Printed per EP, rank and class: the marginal
count per step, (count(L) - count(S)) / (L - S), then the bookkeeping class's and the path calls' top call sites
(marginal per step, with the counts of both runs); `--json FILE` writes all of it.

Not seen (C++ callers, not Python bookkeeping anyway): DDP's bucket all-reduces (its reducer calls the process
group directly) and the backward all-to-alls of the EP exchange (autograd of the functional collective); the
forward exchange is counted.
"""
from __future__ import annotations

import argparse
import builtins
import collections
import io
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _path in (REPO, os.path.join(REPO, "tests", "support")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# tests/conftest.py's MICRO_OVERRIDES (tests/perf/test_count_bookkeeping.py checks that they agree)
MICRO_OVERRIDES = [
    "model.vocab_size=512", "model.d_model=32", "model.n_layers=2", "model.max_seq_len=64",
    "model.attention.n_heads=2", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=32",
    "model.nag.C=4", "model.nag.warmup_tokens=256", "data.seq_len=64", "train.batch_tokens=256",
    "train.warmup_steps=4", "train.eval_tokens=1024", "train.eval_every=0", "train.checkpoint_every=0",
    "train.schedule_steps=20", "train.max_steps=20", "log.wandb=off",
]
DEFAULT_CONFIG = os.path.join(REPO, "configs", "tiny.yaml")
WORLD_SIZE = 2
LOG_EVERY = 10

CLASSES = ("ep_exchange", "grad_reduction", "distributed_muon", "expert_bias_counts", "bookkeeping")
PATH_KINDS = ("stat", "open", "listdir")

# torch.distributed's collectives (both the package's names and distributed_c10d's: torch's own helpers call
# the latter), and the functional collectives (the EP exchange calls all_to_all_single_autograd)
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
               "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "gather", "scatter", "reduce", "barrier", "monitored_barrier", "broadcast_object_list",
               "all_gather_object", "gather_object", "scatter_object_list", "send", "recv", "isend", "irecv",
               "batch_isend_irecv")
FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
              "all_gather_into_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
              "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
              "permute_tensor")
# path calls: (module, attribute, kind)
PATH_CALLS = ((os, "stat", "stat"), (os, "lstat", "stat"), (builtins, "open", "open"), (io, "open", "open"),
              (os, "open", "open"), (os, "listdir", "listdir"), (os, "scandir", "listdir"))

PACKAGE = os.path.join(REPO, "nagmoe") + os.sep
CHAIN = 5  # nagmoe frames kept per call site (the innermost is the site)


# ----------------------------------------------------------------------------------------------------------
# The recorder (in each rank)
# ----------------------------------------------------------------------------------------------------------
def _nagmoe_frames(frame) -> tuple[list[tuple[str, int, str]], set]:
    """(path, line, function) of the nagmoe frames from `frame` outward, innermost first (at most CHAIN), and
    the (path, function) of every nagmoe frame on the stack, with ("torch DDP", "") when torch's DDP module is
    on it (what `classify` reads)."""
    out, seen = [], set()
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE):
            rel = os.path.relpath(path, REPO)
            seen.add((rel, frame.f_code.co_name))
            if len(out) < CHAIN:
                out.append((rel, frame.f_lineno, frame.f_code.co_name))
        elif path.endswith(os.path.join("torch", "nn", "parallel", "distributed.py")):
            seen.add(("torch DDP", ""))
        frame = frame.f_back
    return out, seen


def _chain_text(frames) -> str:
    return " < ".join(f"{p}:{line} {fn}" for p, line, fn in frames) or "(outside nagmoe)"


def classify(seen: set, expert_bias: bool) -> str:
    """The class of a collective from the (path, function) of the nagmoe frames on its stack."""
    files = {p for p, _ in seen}
    if "nagmoe/parallel/expert_parallel.py" in files:
        return "ep_exchange"
    if "nagmoe/parallel/grad_sync.py" in files or "torch DDP" in files:
        return "grad_reduction"
    if "nagmoe/parallel/distributed_muon.py" in files:
        return "distributed_muon"
    if expert_bias and ("nagmoe/train/router_accounting.py", "end_step") in seen:
        return "expert_bias_counts"
    return "bookkeeping"


def normalise(rel: str) -> str:
    """A run-dir path with its step numbers and temporaries' random names folded, so the same site of a
    short and a long run has one key."""
    return re.sub(r"\d+", "N", re.sub(r"\.tmp-[0-9A-Za-z_]+", ".tmp-*", rel))


class Recorder:
    """Wraps the collectives and the path calls of this process (`with Recorder(run_dir, expert_bias):`);
    every call goes through unchanged."""

    def __init__(self, run_dir: str, expert_bias: bool):
        self.roots = {os.path.abspath(run_dir), os.path.realpath(run_dir)}
        self.expert_bias = expert_bias
        self.collectives: collections.Counter = collections.Counter()  # (thread, class, op, chain)
        self.paths: collections.Counter = collections.Counter()  # (thread, kind, op, relpath, chain)
        self._saved: list = []
        self._lock = threading.Lock()
        self._local = threading.local()

    def _thread(self) -> str:
        return "main" if threading.current_thread() is threading.main_thread() else "background"

    # collectives -----------------------------------------------------------------------------------------
    def _wrap_collective(self, original, op: str):
        recorder = self

        def counted(*args, **kwargs):
            local = recorder._local
            if getattr(local, "inside", False):  # made by another wrapped collective: counted there
                return original(*args, **kwargs)
            local.inside = True
            try:
                frames, seen = _nagmoe_frames(sys._getframe(1))
                key = (recorder._thread(), classify(seen, recorder.expert_bias), op, _chain_text(frames))
                with recorder._lock:
                    recorder.collectives[key] += 1
                return original(*args, **kwargs)
            finally:
                local.inside = False

        counted.__wrapped__ = original
        return counted

    # path calls ------------------------------------------------------------------------------------------
    def _inside_run_dir(self, args, kwargs, op: str):
        """The run-dir-relative path of the call's path argument, or None (elsewhere, a file descriptor)."""
        if args:
            path = args[0]
        else:
            path = kwargs.get("path", kwargs.get("file", "." if op in ("os.listdir", "os.scandir") else None))
        if path is None or isinstance(path, int):
            return None
        try:
            path = os.fsdecode(path)
        except TypeError:
            return None
        dir_fd = kwargs.get("dir_fd")
        if dir_fd is not None and not os.path.isabs(path):
            try:
                path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            except OSError:
                return None
        path = os.path.abspath(path)
        for root in self.roots:
            if path == root or path.startswith(root + os.sep):
                return os.path.relpath(path, root)
        return None

    def _wrap_path(self, original, op: str, kind: str):
        recorder = self

        def counted(*args, **kwargs):
            local = recorder._local
            if getattr(local, "inside", False):
                return original(*args, **kwargs)
            local.inside = True
            try:
                rel = recorder._inside_run_dir(args, kwargs, op)
                if rel is not None:
                    frames, _ = _nagmoe_frames(sys._getframe(1))
                    key = (recorder._thread(), kind, op, normalise(rel), _chain_text(frames))
                    with recorder._lock:
                        recorder.paths[key] += 1
            finally:
                local.inside = False
            return original(*args, **kwargs)

        counted.__wrapped__ = original
        return counted

    # install ---------------------------------------------------------------------------------------------
    def _patch(self, module, name: str, wrapper) -> None:
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, wrapper)

    def __enter__(self) -> "Recorder":
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        wrappers: dict = {}  # one wrapper per original function, whichever module names it
        for module in (dist, c10d):
            for name in COLLECTIVES:
                original = getattr(module, name, None)
                if original is None:
                    continue
                if id(original) not in wrappers:
                    wrappers[id(original)] = self._wrap_collective(original, f"dist.{name}")
                self._patch(module, name, wrappers[id(original)])
        for name in FUNCTIONAL:
            original = getattr(funcol, name, None)
            if original is not None:
                self._patch(funcol, name, self._wrap_collective(original, f"funcol.{name}"))
        for module, name, kind in PATH_CALLS:
            original = getattr(module, name)
            op = f"{'open' if module is builtins or module is io else 'os.' + name}"
            if id(original) not in wrappers:
                wrappers[id(original)] = self._wrap_path(original, op, kind)
            self._patch(module, name, wrappers[id(original)])
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def result(self) -> dict:
        with self._lock:
            return {"collectives": [[*k, n] for k, n in self.collectives.items()],
                    "paths": [[*k, n] for k, n in self.paths.items()]}


def rank_run(config_path: str, overrides: list, run_dir: str) -> dict:
    """On each gloo rank: build and run the trainer under a Recorder; its counts."""
    import torch

    from nagmoe.config import load_config
    from nagmoe.train.trainer import Trainer

    torch.set_num_threads(1)  # (gloo_ranks does too)
    cfg = load_config(config_path, overrides)
    expert_bias = cfg.model.ffn == "moe" and bool(cfg.model.moe.expert_bias)
    started = time.perf_counter()
    with Recorder(run_dir, expert_bias) as recorder:
        trainer = Trainer(cfg, run_dir, quiet=True)
        summary = trainer.run()
    return {"steps": summary["steps"], "wall_s": time.perf_counter() - started, **recorder.result()}


# ----------------------------------------------------------------------------------------------------------
# The parent: runs, marginal counts, report
# ----------------------------------------------------------------------------------------------------------
def prepare_micro_data(root: str) -> tuple[str, str]:
    """tests/conftest.py's micro_data: a prepared data dir (vocab 512) from 60 Shakespeare scenes."""
    from nagmoe.config import load_config
    from nagmoe.data.corpus import iter_documents, resolve_corpus
    from nagmoe.data.prepare import prepare_single

    os.makedirs(root, exist_ok=True)
    corpus, data_dir = os.path.join(root, "corpus.jsonl"), os.path.join(root, "data")
    docs = list(iter_documents(resolve_corpus("shakespeare")))[:60]
    with open(corpus, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    cfg = load_config(DEFAULT_CONFIG, [*MICRO_OVERRIDES, f"data.corpus={corpus}", f"data.data_dir={data_dir}",
                                       "data.val_fraction=0.1"])
    prepare_single(cfg)
    return data_dir, corpus


def _sum(rows, thread: str, index: int) -> collections.Counter:
    """Counts of the rows of `thread` by field `index` (class or kind)."""
    out: collections.Counter = collections.Counter()
    for row in rows:
        if row[0] == thread:
            out[row[index]] += row[-1]
    return out


def _sites(short_rows, long_rows, keep, key, span: int) -> list[dict]:
    counts: dict = {}
    for which, rows in (("short", short_rows), ("long", long_rows)):
        for row in rows:
            if keep(row):
                k = key(row)
                counts.setdefault(k, {"short": 0, "long": 0})[which] += row[-1]
    sites = [{**k, **c, "per_step": (c["long"] - c["short"]) / span} for k, c in
             ((dict(k), c) for k, c in counts.items())]
    sites.sort(key=lambda s: (-abs(s["per_step"]), -s["long"]))
    return sites


def marginal(short: dict, long: dict, span: int) -> dict:
    """One rank's marginal counts per step between its short and long run."""
    def per_step(field, index, names, thread):
        a, b = _sum(short[field], thread, index), _sum(long[field], thread, index)
        out = {n: (b[n] - a[n]) / span for n in names}
        out.update({n: (b[n] - a[n]) / span for n in sorted(set(a) | set(b)) if n not in out})
        return out

    paths = per_step("paths", 1, PATH_KINDS, "main")
    paths["total"] = sum(paths[k] for k in PATH_KINDS)
    background_paths = per_step("paths", 1, PATH_KINDS, "background")
    background_paths["total"] = sum(background_paths[k] for k in PATH_KINDS)
    return {
        "collectives": per_step("collectives", 1, CLASSES, "main"),
        "paths": paths,
        "background": {"collectives": sum(per_step("collectives", 1, CLASSES, "background").values()),
                       "paths": background_paths["total"]},
        "totals": {"short": {"collectives": dict(_sum(short["collectives"], "main", 1)),
                             "paths": dict(_sum(short["paths"], "main", 1))},
                   "long": {"collectives": dict(_sum(long["collectives"], "main", 1)),
                            "paths": dict(_sum(long["paths"], "main", 1))}},
        "bookkeeping_sites": _sites(short["collectives"], long["collectives"],
                                    lambda r: r[0] == "main" and r[1] == "bookkeeping",
                                    lambda r: (("op", r[2]), ("site", r[3])), span),
        "collective_sites": _sites(short["collectives"], long["collectives"], lambda r: r[0] == "main",
                                   lambda r: (("class", r[1]), ("op", r[2]), ("site", r[3])), span),
        "path_sites": _sites(short["paths"], long["paths"], lambda r: r[0] == "main",
                             lambda r: (("kind", r[1]), ("op", r[2]), ("path", r[3]), ("site", r[4])), span),
        "background_sites": _sites(short["paths"], long["paths"], lambda r: r[0] == "background",
                                   lambda r: (("kind", r[1]), ("op", r[2]), ("path", r[3]), ("site", r[4])),
                                   span),
        "wall_s": {"short": short["wall_s"], "long": long["wall_s"]},
    }


def run_pair(config_path: str, base: list, ep: int, steps: tuple[int, int], work: str, timeout: float) -> dict:
    from gloo_ranks import run_on_ranks

    short_steps, long_steps = steps
    runs = {}
    for which, n in (("short", short_steps), ("long", long_steps)):
        overrides = [*base, f"parallel.ep={ep}", f"train.max_steps={n}", f"train.schedule_steps={long_steps}"]
        run_dir = os.path.join(work, f"ep{ep}_{which}")
        runs[which] = run_on_ranks(rank_run, WORLD_SIZE, config_path, overrides, run_dir, timeout=timeout)
        for r, out in enumerate(runs[which]):
            if out["steps"] != n:
                raise AssertionError(f"ep {ep} {which} run, rank {r}: {out['steps']} steps, not {n}")
    return {"ranks": [{"rank": r, **marginal(runs["short"][r], runs["long"][r], long_steps - short_steps)}
                      for r in range(WORLD_SIZE)]}


def _fmt(v: float) -> str:
    return f"{v:7.2f}"


def report(result: dict, top: int) -> str:
    lines = []
    short_steps, long_steps = result["steps"]
    for key, run in result["runs"].items():
        lines.append(f"== {key}: {WORLD_SIZE} gloo ranks, {short_steps} vs {long_steps} steps, log.every="
                     f"{result['log_every']}: marginal count per step and rank ==")
        ranks = run["ranks"]
        header = "  " + " " * 26 + "".join(f"  rank {r['rank']}" for r in ranks)
        lines.append(header)
        lines.append("  collectives (main thread)")
        for c in CLASSES:
            lines.append(f"    {c:<24}" + "".join(f" {_fmt(r['collectives'][c])}" for r in ranks))
        lines.append("  run-dir path calls (main thread)")
        for k in (*PATH_KINDS, "total"):
            lines.append(f"    {k:<24}" + "".join(f" {_fmt(r['paths'][k])}" for r in ranks))
        lines.append("  background threads")
        for k in ("collectives", "paths"):
            lines.append(f"    {k:<24}" + "".join(f" {_fmt(r['background'][k])}" for r in ranks))
        for r in ranks:
            lines.append(f"  rank {r['rank']} (wall s: short {r['wall_s']['short']:.1f}, long "
                         f"{r['wall_s']['long']:.1f}): top bookkeeping collective sites (per step | short, long)")
            for s in r["bookkeeping_sites"][:top]:
                lines.append(f"    {s['per_step']:6.2f} | {s['short']:4d} {s['long']:4d}  {s['op']}  {s['site']}")
            lines.append(f"  rank {r['rank']}: top run-dir path sites (per step | short, long)")
            for s in r["path_sites"][:top]:
                lines.append(f"    {s['per_step']:6.2f} | {s['short']:4d} {s['long']:4d}  {s['op']} "
                             f"{s['path']}  {s['site']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--config", default=None, help="a config of its own (default: configs/tiny.yaml + the micro "
                                                   "overrides on micro data)")
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, nargs=2, default=[10, 40], metavar=("S", "L"))
    p.add_argument("--data-dir", default=None, help="a prepared micro data dir (else prepared here)")
    p.add_argument("--corpus", default=None)
    p.add_argument("--work-dir", default=None, help="where the run dirs go (default: a temporary, removed)")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per 2-rank run")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    short_steps, long_steps = args.steps
    if not 0 < short_steps < long_steps:
        p.error("--steps S L needs 0 < S < L")

    # one OpenMP thread in the ranks (a forkserver started now inherits it; each rank also sets torch's
    # threads to 1); this process's own environment is given back afterwards
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    work = args.work_dir or tempfile.mkdtemp(prefix="count_bookkeeping_")
    os.makedirs(work, exist_ok=True)
    try:
        if args.config is None:
            config_path = DEFAULT_CONFIG
            data_dir, corpus = args.data_dir, args.corpus
            if data_dir is None:
                data_dir, corpus = prepare_micro_data(os.path.join(work, "micro_data"))
            base = [*MICRO_OVERRIDES, f"data.data_dir={data_dir}", *([f"data.corpus={corpus}"] if corpus else [])]
        else:
            config_path, base = args.config, []
        base = [*base, *args.overrides, f"log.every={LOG_EVERY}", "train.hang_timeout_s=0", "log.wandb=off"]
        result = {"world_size": WORLD_SIZE, "steps": [short_steps, long_steps], "log_every": LOG_EVERY,
                  "config": config_path, "overrides": base, "classes": list(CLASSES), "path_kinds": list(PATH_KINDS),
                  "runs": {}}
        for ep in args.ep:
            result["runs"][f"ep{ep}"] = run_pair(config_path, base, ep, (short_steps, long_steps), work,
                                                 args.timeout)
    finally:
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(report(result, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
