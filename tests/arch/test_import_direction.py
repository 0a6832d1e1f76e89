"""Imports run one way (issues 20, 54): the folders are the layers of the pipeline, and a module imports its own
folder or a folder of a lower layer, never one above it nor a sibling of its own layer.

    base -> config -> ops, cuda_rules -> model, data -> rundir -> checkpoint, parallel -> eval -> analysis, hf
         -> train -> launch -> commands -> cli

The graph counts every import statement, lazy ones inside functions too (tests/arch/import_graph.py)."""
import os

import pytest

from import_graph import ROOT, cycles, import_graph, package_modules

GRAPH = import_graph()

LAYERS = [("base",), ("config",), ("ops", "cuda_rules"), ("model", "data"), ("rundir",), ("checkpoint", "parallel"),
          ("eval",), ("analysis", "hf"), ("train",), ("launch",), ("commands",), ("cli",)]
RANK = {folder: rank for rank, folders in enumerate(LAYERS) for folder in folders}

# The modules at the top of the package, and the folder each belongs to. `nagmoe` itself (the version) is below
# everything; `nagmoe.flops` re-exports nagmoe.config.flops, a contract name (DESIGN.md) for users, not for the
# package's own code.
TOP_LEVEL = {"nagmoe.cli": "cli", "nagmoe.__main__": "cli", "nagmoe.flops": "config"}


def folder_of(module: str) -> str | None:
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else None


def test_every_module_sits_in_a_layer():
    """At most three modules at the top of the package (issue 54): the command, `python -m nagmoe`, the contract
    name nagmoe.flops; everything else sits in a folder of the pipeline."""
    assert sorted(m for m in GRAPH if m != "nagmoe" and folder_of(m) not in RANK) == []
    top = os.path.normpath(ROOT)
    loose = sorted(m for m, path in package_modules().items()
                   if os.path.normpath(os.path.dirname(path)) == top and not path.endswith("__init__.py"))
    assert loose == sorted(TOP_LEVEL)


@pytest.mark.parametrize("folder", sorted(RANK))
def test_imports_run_down_the_layers(folder):
    """Neither up (analysis -> train) nor sideways (eval -> analysis, model -> data): a module of `folder` imports
    its own folder or a lower layer's."""
    assert any(folder_of(m) == folder for m in GRAPH), f"no module in {folder}/"
    wrong = [f"{m} -> {t}" for m, targets in GRAPH.items() if folder_of(m) == folder for t in targets
             if folder_of(t) in RANK and folder_of(t) != folder and RANK[folder_of(t)] >= RANK[folder]]
    assert sorted(wrong) == []


def test_a_job_script_renders_without_the_training_stack():
    """launch/'s job-script modules (slurm, pinned_config) sit above train only because launch/experiment.py runs
    the trainer in-process: rendering or submitting a job imports nothing of parallel, train, eval, analysis, hf."""
    stack = {"parallel", "train", "eval", "analysis", "hf"}
    wrong = [f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
             if m.startswith("nagmoe.launch.") and m != "nagmoe.launch.experiment" and folder_of(t) in stack]
    assert sorted(wrong) == []


def test_the_package_imports_the_accounting_by_its_home_not_by_the_contract_name():
    """`nagmoe.flops` is for users and tests (DESIGN.md); inside the package the accounting is nagmoe.config.flops."""
    assert sorted(m for m, targets in GRAPH.items() if "nagmoe.flops" in targets and m != "nagmoe.flops") == []


def test_the_base_layer_imports_no_other_layer():
    """base/ (errors, the one writer and reader, the environment's variables) is used from every layer."""
    assert sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if folder_of(m) == "base"
                  for t in targets if folder_of(t) != "base") == []


def test_the_one_writer_imports_only_the_errors():
    """nagmoe/base/files.py (issue 40) is used from every layer: it imports nothing of nagmoe but errors.py."""
    assert {t for t in GRAPH["nagmoe.base.files"] if t.startswith("nagmoe")} == {"nagmoe.base.errors"}


def test_the_hf_model_files_import_nothing_of_nagmoe():
    """nagmoe/hf/remote/ ships as remote code (issue 42): its files import each other, never the rest of nagmoe;
    nagmoe/hf/check.py runs in a process where nagmoe cannot be imported."""
    shipped = {m: t for m, t in GRAPH.items() if m.startswith("nagmoe.hf.remote.") or m == "nagmoe.hf.check"}
    assert len(shipped) == 5, "the graph sees nagmoe/hf/remote/ and nagmoe/hf/check.py"
    assert sorted(f"{m} -> {t}" for m, targets in shipped.items() for t in targets
                  if t.startswith("nagmoe") and not t.startswith("nagmoe.hf.remote.")) == []
    assert "nagmoe.hf.remote.layers_nagmoe" in GRAPH["nagmoe.hf.remote.modeling_nagmoe"]  # relative imports are seen


def test_no_import_circle():
    assert cycles(GRAPH) == []


def test_the_graph_sees_lazy_and_relative_imports():
    """The checks above would pass vacuously on a graph that missed edges: pin a few known ones."""
    assert "nagmoe.checkpoint.torch_layout" in GRAPH["nagmoe.checkpoint.reader"]      # from pkg import module
    assert "nagmoe.train.trainer" in GRAPH["nagmoe.commands.train"]                    # inside a function
    assert "nagmoe.config.flops" in GRAPH["nagmoe.config.load"] and "nagmoe.config.schema" in GRAPH["nagmoe.config.flops"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
