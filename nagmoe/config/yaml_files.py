"""Every YAML file the package reads (configs, experiments, a CORE bundle's core.yaml, a run dir's saved
config.yaml) and every override value goes through `load_yaml`: YAML 1.2 booleans, read as UTF-8 whatever the
locale, and bounded before anything is built from it (issue 41):

  * nesting at most MAX_DEPTH levels (5,000 levels were a RecursionError in the composer);
  * at most MAX_NODES nodes once aliases are expanded: a 446-byte, 7-level alias bomb is cheap to build (the
    aliases share objects) but printed, merged or copied it is 10**7 nodes; the count is taken on the composed
    graph, each node once, so checking costs what the file costs;
  * a mapping with the same key twice is refused naming the key and both lines (the last one used to win
    silently, e.g. two `model:` blocks);
  * a number with more digits than Python converts, a recursive alias, anything else the loader raises:
    one line, never a traceback.
A failure is a YAMLBoundError (a yaml.YAMLError, so existing `except yaml.YAMLError` callers keep their message)
whose text is one short line."""
from __future__ import annotations

import os
import re

import yaml

from nagmoe.base.errors import UserError, shown

MAX_DEPTH = 64
MAX_NODES = 100_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class YAMLBoundError(yaml.YAMLError):
    """A YAML text over one of this module's bounds, or one the loader could not build: one line."""


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans (only true/false: `wandb: off` stays the string "off"), a nesting bound,
    an expanded-size bound and duplicate keys refused."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLBoundError(f"nested deeper than {MAX_DEPTH} levels (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node)
        return self.construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise YAMLBoundError(f"duplicate key {shown(key, 80)} at line {line} (first at line "
                                         f"{seen[key]}): remove one")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


BoundedLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _check_expanded_size(root) -> None:
    """Nodes of the document with every alias expanded, counted without expanding: each node's expanded size
    once (memoised by identity), iteratively (the graph is at most MAX_DEPTH deep, but an alias may point back
    into its own anchor: a recursive alias is refused)."""
    size: dict[int, int] = {}
    stack = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in size:
            continue
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if not children_done:
            if key in on_path:
                raise YAMLBoundError(f"a recursive alias (line {node.start_mark.line + 1})")
            on_path.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in size)
            continue
        on_path.discard(key)
        total = 1 + sum(size.get(id(child), 0) for child in children)
        if total > MAX_NODES:
            raise YAMLBoundError(f"more than {MAX_NODES:,} values once its aliases are expanded (an alias bomb?); "
                                 f"line {node.start_mark.line + 1}")
        size[key] = total


MAX_CHAIN = 32  # files in one inherit (configs) or include (experiments) chain


def next_in_chain(path: str, chain: tuple, what: str, error=UserError) -> str:
    """The real path of `path`, the next file of an `inherit`/`include` chain whose files so far (real paths)
    are `chain`: a cycle is named as one (a symlink or `./` cannot hide it), a chain is at most MAX_CHAIN files,
    a path the OS cannot take (a NUL byte) is refused. `error`: the UserError subclass to raise."""
    try:
        real = os.path.realpath(path)
    except (ValueError, OSError):
        raise error(f"{what}: {shown(path, 80)} is not a usable path") from None
    if real in chain:
        raise error(f"{what} cycle: " + " -> ".join(shown(os.path.basename(p), 60) for p in (*chain, real)))
    if len(chain) >= MAX_CHAIN:
        raise error(f"{shown(path)}: {what} chain longer than {MAX_CHAIN} files")
    return real


def parse(text_or_stream):
    """yaml.load with BoundedLoader; every failure a yaml.YAMLError (YAMLBoundError for what PyYAML itself would
    raise as RecursionError or ValueError) with a one-line message. `nagmoe.config.yaml_load` is this."""
    try:
        return yaml.load(text_or_stream, Loader=BoundedLoader)
    except RecursionError:
        raise YAMLBoundError("nested too deeply") from None
    except (ValueError, OverflowError) as e:  # e.g. an integer beyond Python's digit limit
        raise YAMLBoundError(shown(str(e), 200)[1:-1]) from None


def load_yaml(text: str, where: str, error=UserError):
    """The YAML document in `text` (str, already decoded); any failure is `error` (a UserError subclass)
    '<where>: invalid YAML (<one line>)'. `where` is shown as given: pass a shown() path."""
    try:
        return parse(text)
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "parse error"
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            first = f"{getattr(e, 'problem', None) or first} at line {mark.line + 1}"
        raise error(f"{where}: invalid YAML ({shown(first, 300)[1:-1]})") from None


def read_yaml(path: str):
    """The YAML file at `path`, read as UTF-8 (never the locale's encoding), bounded as `load_yaml`."""
    from nagmoe.base.files import read_text

    return load_yaml(read_text(path), shown(path))
