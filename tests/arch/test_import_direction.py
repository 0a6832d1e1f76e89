"""Imports run one way (issue 20): the layers of the package and the checkpoint package's place in them.

The graph counts every import statement, lazy ones inside functions too (tests/arch/import_graph.py)."""
import pytest

from import_graph import cycles, import_graph

GRAPH = import_graph()


def _importers(prefixes: tuple[str, ...], forbidden: str) -> list[str]:
    return sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if m.startswith(prefixes)
                  for t in targets if t == forbidden or t.startswith(forbidden + "."))


@pytest.mark.parametrize("layer,forbidden", [
    (("nagmoe.parallel", "nagmoe.eval"), "nagmoe.train"),
    (("nagmoe.checkpoint",), "nagmoe.train"),
    (("nagmoe.checkpoint",), "nagmoe.parallel"),
    (("nagmoe.ops",), "nagmoe.model"),
    (("nagmoe.model",), "nagmoe.train"),
    (("nagmoe.model",), "nagmoe.parallel"),
    (("nagmoe.model",), "nagmoe.checkpoint"),
    (("nagmoe.schema", "nagmoe.flops", "nagmoe.nag_math", "nagmoe.errors", "nagmoe.safe_files"), "nagmoe.config"),
    (("nagmoe.analysis",), "nagmoe.commands"),
    (("nagmoe.eval",), "nagmoe.commands"),
])
def test_layer_does_not_import_upwards(layer, forbidden):
    assert _importers(layer, forbidden) == []


def test_the_one_writer_sits_in_layer_1():
    """nagmoe/safe_files.py (issue 40) is used from every layer: it imports nothing of nagmoe but errors.py."""
    assert {t for t in GRAPH["nagmoe.safe_files"] if t.startswith("nagmoe")} == {"nagmoe.errors"}


def test_the_hf_model_files_import_nothing_of_nagmoe():
    """nagmoe/hf/ ships as remote code (issue 42): its files import each other, never the rest of nagmoe."""
    hf = {m: t for m, t in GRAPH.items() if m.startswith("nagmoe.hf.")}
    assert hf, "the graph sees nagmoe/hf/"
    assert sorted(f"{m} -> {t}" for m, targets in hf.items() for t in targets
                  if t.startswith("nagmoe") and not t.startswith("nagmoe.hf.")) == []
    assert "nagmoe.hf.layers_nagmoe" in GRAPH["nagmoe.hf.modeling_nagmoe"]  # relative imports are seen


def test_no_import_circle():
    assert cycles(GRAPH) == []


def test_the_graph_sees_lazy_and_relative_imports():
    """The checks above would pass vacuously on a graph that missed edges: pin a few known ones."""
    assert "nagmoe.checkpoint.torch_layout" in GRAPH["nagmoe.checkpoint.reader"]      # from pkg import module
    assert "nagmoe.train.trainer" in GRAPH["nagmoe.commands.train"]                    # inside a function
    assert "nagmoe.flops" in GRAPH["nagmoe.config"] and "nagmoe.schema" in GRAPH["nagmoe.flops"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
