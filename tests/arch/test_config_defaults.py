"""A config default has two homes (issue 54): the dataclass in nagmoe/config/schema.py, and LEGACY_VALUES for a run dir
saved before the key existed. The model and the trainer read a Config's fields as they are: a
`getattr(cfg, "field", fallback)` is a third home that is dead for a real Config and silently legacy for anything
else (six of them disagreed with the schema)."""
import ast
import dataclasses
import os

from import_graph import ROOT

from nagmoe.config import schema

FIELDS = {f.name for cls in vars(schema).values() if dataclasses.is_dataclass(cls) and isinstance(cls, type)
          for f in dataclasses.fields(cls)}
FOLDERS = ("model", "train", "parallel", "ops")
# how these folders name a Config or one of its sections (a module attribute of the same name, as a layer's
# `expert_bias`, is no config default)
CONFIG_NAMES = {"cfg", "config", "model_cfg", "train_cfg", "t", "m", "mod", "nag", "moe"}


def _is_config(node) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in CONFIG_NAMES


def test_no_fallback_for_a_config_field_in_the_model_or_the_trainer():
    found = []
    for folder in FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                found += [f"{os.path.relpath(path, ROOT)}:{node.lineno}: getattr(..., {node.args[1].value!r}, ...)"
                          for node in ast.walk(tree)
                          if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                          and len(node.args) == 3 and _is_config(node.args[0])
                          and isinstance(node.args[1], ast.Constant) and node.args[1].value in FIELDS]
    assert found == []


def test_the_check_sees_the_schemas_fields():
    assert {"capacity_factor", "gate_grad", "base_init_std", "threshold", "precision", "flop_convention"} <= FIELDS
