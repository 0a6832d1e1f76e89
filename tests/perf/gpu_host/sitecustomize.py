"""A GPU host stood in on a CPU machine, for the rehearsal of tools/gpu_check/gpu_check.sh (tests/perf/
test_gpu_check_rehearsal.py). Loaded first by every Python process of the rehearsal (its folder leads PYTHONPATH),
it then runs the next sitecustomize on the path (the script's own import blocker).

What it changes, once `torch` is imported: `torch.cuda.is_available()` is True and the device queries answer as
one H200 would (name, capability 9.0, 141 GiB, memory counters 0, synchronize a no-op), so every branch a section
takes on a CUDA host is taken. No CUDA tensor can be made: the first CUDA work (torch's lazy CUDA init, which every
CUDA tensor goes through) raises `CudaWorkReached`, after writing the process's CPU-side seconds so far to
$GPU_REHEARSAL_LOG. What a section does on the host before its GPU work, and how long, is what the rehearsal
measures; the GPU work itself is what the real machine measures.
"""
import importlib.abc
import importlib.util
import os
import sys
import time
import types

_T0 = time.time()
_GIB = 1 << 30
_HERE = os.path.dirname(os.path.abspath(__file__))


class CudaWorkReached(RuntimeError):
    """The first CUDA work of a process on the stand-in GPU host."""


def _reached(*_args, **_kwargs):
    elapsed = time.time() - _T0
    log = os.environ.get("GPU_REHEARSAL_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\t{elapsed:.2f}\t{' '.join(sys.argv)[:200]}\n")
    raise CudaWorkReached(f"GPU rehearsal: CUDA work reached after {elapsed:.1f} s on the host "
                          "(no CUDA device on this machine)")


def _answer(name: str, value):
    """A distinct function per name: dynamo keeps one rule per torch.cuda object, so no two may be the same one."""

    def fn(*_args, **_kwargs):
        return value

    fn.__name__ = fn.__qualname__ = name
    return fn


def _patch_torch(torch) -> None:
    props = types.SimpleNamespace(name="NVIDIA H200 (rehearsal)", gcnArchName="", major=9, minor=0,
                                  total_memory=141 * _GIB, L2_cache_size=60 << 20,
                                  multi_processor_count=132)
    answers = {"is_available": True, "device_count": 1, "current_device": 0, "get_device_name": props.name,
               "get_device_capability": (9, 0), "get_device_properties": props, "is_bf16_supported": True}
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        answers[name] = 0
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats", "set_sync_debug_mode", "set_device",
                 "manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"):
        answers[name] = None
    rng = torch.zeros(16, dtype=torch.uint8)  # dynamo saves and restores CUDA's RNG state around each frame
    answers.update(get_rng_state=rng, get_rng_state_all=[rng], initial_seed=0)
    for name, value in answers.items():
        setattr(torch.cuda, name, _answer(name, value))
    for name, module in list(sys.modules.items()):  # submodules bound torch.cuda's lazy init by name
        if (name == "torch.cuda" or name.startswith("torch.cuda.")) and hasattr(module, "_lazy_init"):
            module._lazy_init = _reached


def _patch_probe(module) -> None:
    """The real per-op autocast probe needs CUDA tensors: here it runs on fake CUDA tensors under the real CUDA
    autocast (the probe's own `cuda-fake` mode), the same host-side work."""
    probe = module.probe
    module.probe = lambda mode, rules=None: probe("cuda-fake" if mode == "cuda" else mode, rules)


def _patch_train(module) -> None:
    """The bf16 matmul peak is GPU work only: stood in (the training sections time it beside the Trainer)."""
    module.matmul_flops = lambda device, n: {"n": n, "dtype": "bfloat16", "flops_per_s": 1.0,
                                             "rehearsal": "stood in"}


PATCHES = {"torch": _patch_torch, "nagmoe.cuda_rules.probe": _patch_probe, "gpu_check_train": _patch_train}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches each module of PATCHES right after its first import (importing torch here would cost every
    process ~2 s, and most never need it)."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES or getattr(self, "busy", None) == name:
            return None
        self.busy = name
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = None
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())


def _next_sitecustomize() -> None:
    """Run the sitecustomize this one shadows (tools/gpu_check/gpu_check.sh's import blocker), if any."""
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == _HERE:
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_gpu_check_sitecustomize", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_next_sitecustomize()
