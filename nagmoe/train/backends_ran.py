"""What actually ran, from the modules' own records (issue 38): the backends configured at start can differ from
the kernels a step runs (grouped -> loop for a dtype or alignment, flash-attn -> SDPA for fp32 inputs, SDPA's
kernel choice), and a fallback must not stay invisible.

Each MoE layer and attention module keeps `ran` ({"experts" | "attention" | "attention_at_positions": path}),
set in its forward from python-level decisions only (no host read). `collect(model)` summarises them as
{kind: {path: number of modules}}, plus `fallbacks` {module name: path} for every path that fell back; the
Trainer merges the summaries of its steps and rewrites `backends_ran` in run_info.json whenever something new
ran (after step 1, and when MoD first skips).
"""
from __future__ import annotations

from torch import nn


def _in_compiled_graph(module: nn.Module) -> dict:
    """A compiled sublayer records nothing inside its graph (nagmoe.model.common.recording): its experts ran there
    only as grouped `_grouped_mm` (nagmoe.train.speed: any other expert path runs eagerly and records itself), its
    attention as the configured impl with the compiler's kernel choice."""
    if "_compiled_forward" not in module.__dict__:
        return {}
    if hasattr(module, "run_experts"):
        return {"experts": "grouped (in the compiled graph)"}
    return {"attention": f"{module.impl} (in the compiled graph)"} if hasattr(module, "impl") else {}


def collect(model: nn.Module) -> dict:
    out: dict = {}
    for name, module in model.named_modules():
        if getattr(module, "ran", None) is None:
            continue
        for kind, path in {**_in_compiled_graph(module), **module.ran}.items():
            counts = out.setdefault(kind, {})
            counts[path] = counts.get(path, 0) + 1
            if "fallback" in path or path.startswith("sdpa (flash-attn"):
                out.setdefault("fallbacks", {})[f"{name}.{kind}"] = path
    return out


def merge(seen: dict, new: dict) -> bool:
    """Fold `new` into `seen` (per path, the larger module count); True when something was not seen before."""
    changed = False
    for kind, paths in new.items():
        into = seen.setdefault(kind, {})
        for path, value in paths.items():
            if kind == "fallbacks":
                changed |= into.get(path) != value
                into[path] = value
            elif value > into.get(path, 0):
                changed |= path not in into
                into[path] = value
    return changed
