"""Every message of the config schema (nagmoe/config/schema.py, nagmoe/config/load.py), of `import-hf`'s config reader and of
the safetensors header reader stays bounded whatever it is given (issue 53 item 2): keys and values of every
length, through every leaf key, every section and every entry point (a dict as a saved config or config.json
is read, a dotted override, a YAML file). The bound: a message does not grow with its input — the longest
message for a megabyte input is at most SHOWN_BUDGET characters longer than for a 10-character one (two values
of `errors.shown`'s ~240 each), and never over ABSOLUTE characters."""
import dataclasses
import json
import struct

from nagmoe.config import load_config
from nagmoe.base.errors import UserError
from nagmoe.config.schema import Config

SHOWN_BUDGET = 500
ABSOLUTE = 1500  # the longest fixed text: the known keys of the largest section (train) and a shown value
SMALL, LARGE = 10, 20_000  # the megabyte cases: the last test


def leaf_keys(obj=None, prefix=""):
    obj = Config() if obj is None else obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaf_keys(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def section_prefixes():
    return sorted({k.rsplit(".", 1)[0] + "." for k in leaf_keys() if "." in k})


def nested(dotted: str, value) -> dict:
    out = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def values(n: int) -> list:
    """Values of size ~n of every kind a YAML or JSON reader can produce."""
    return ["x" * n, ["x"] * n, {"k" * n: "v" * n}, 10 ** min(n, 4000), -(10 ** min(n, 4000)), [[["x" * n]]],
            b"x" * n]


def message(call) -> str:
    try:
        call()
    except UserError as e:
        return str(e)
    return ""


def dict_route(dotted, value):
    from nagmoe.config import config_from_dict
    return lambda: config_from_dict(nested(dotted, value))


def override_route(dotted, text):
    return lambda: load_config(None, [f"{dotted}={text}"])


def cases(n: int):
    """(name, callable) pairs: every message site fed inputs of size n."""
    for key in leaf_keys():
        for i, v in enumerate(values(n)):
            yield f"dict {key} value#{i}", dict_route(key, v)
        yield f"override {key} str", override_route(key, "x" * n)
    for key in ("model.d_model", "train.lr_gate", "model.residual", "data.corpus"):  # one per type: PyYAML is slow
        yield f"override {key} list", override_route(key, "[" + "1," * n + "]")
    for prefix in ["", *section_prefixes()]:
        yield f"dict unknown key under {prefix!r}", dict_route(prefix + "k" * n, 1)
        yield f"override unknown key under {prefix!r}", override_route(prefix + "k" * n, "1")
        if prefix:
            yield f"dict section {prefix!r} as a value", dict_route(prefix.rstrip("."), "x" * n)
            yield f"override section {prefix!r}", override_route(prefix.rstrip("."), "x" * n)
    yield "override without =", lambda: load_config(None, ["k" * n])
    yield "override under a leaf", override_route("model.d_model." + "k" * n, "1")
    yield "dict non-string key", dict_route("model", {10 ** min(n, 4000): 1})


def yaml_cases(n: int, tmp_path):
    path = tmp_path / f"c{n}.yaml"
    for i, text in enumerate([f"{'k' * n}: 1\n", f"model: {{d_model: {'9' * n}}}\n", f"inherit: {'p' * n}\n",
                              f"model: {{{'9' * min(n, 4000)}: 1}}\n", "- " + "x" * n + "\n"]):
        def call(text=text):
            path.write_text(text)
            load_config(str(path))
        yield f"yaml file #{i}", call


def export_config_cases(n: int, tmp_path):
    from nagmoe.hf.importer import read_export_config

    base = {"model_type": "nagmoe", "nagmoe_model": {}, "seq_len": 64, "precision": "uniform"}
    for i, change in enumerate([{"model_type": "x" * n}, {"nagmoe_model": ["x"] * n}, {"seq_len": "x" * n},
                                {"precision": ["x" * n]}, {"model_type": {"k" * n: 1}}]):
        def call(change=change, i=i):
            d = tmp_path / f"export{n}_{i}"
            d.mkdir(exist_ok=True)
            (d / "config.json").write_text(json.dumps({**base, **change}))
            read_export_config(str(d))
        yield f"config.json #{i}", call


def header_cases(n: int, tmp_path):
    from nagmoe.hf.safetensors_header import read_header

    for i, header in enumerate([{"t" * n: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                                {"t": {"dtype": "x" * n, "shape": [1], "data_offsets": [0, 4]}},
                                {"t": {"dtype": "F32", "shape": [1] * n, "data_offsets": [0, 4]}},
                                {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0] * n}},
                                {"t": {"dtype": "F32", "shape": ["x" * n], "data_offsets": [0, 4]}},
                                {"t" * n: "v" * n}]):
        def call(header=header, i=i):
            raw = json.dumps(header).encode()
            p = tmp_path / f"h{n}_{i}.safetensors"
            p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
            read_header(str(p))
        yield f"safetensors header #{i}", call


def all_messages(n: int, tmp_path) -> dict:
    out = {}
    for source in (cases(n), yaml_cases(n, tmp_path), export_config_cases(n, tmp_path),
                   header_cases(n, tmp_path)):
        for name, call in source:
            out[name] = message(call)
    return out


def test_no_message_grows_with_its_input(tmp_path):
    small, large = all_messages(SMALL, tmp_path), all_messages(LARGE, tmp_path)
    assert sum(bool(m) for m in large.values()) > 0.9 * len(large)  # the inputs are refused, not accepted
    grown = {name: (len(small[name]), len(m), m[:300]) for name, m in large.items()
             if len(m) > ABSOLUTE or len(m) > len(small[name]) + SHOWN_BUDGET}
    assert not grown, grown


def test_a_megabyte_key_or_value_is_a_few_hundred_characters(tmp_path):
    """The cases of the issue at full size: a 1 MB unknown key (dict and override) and a 1 MB value."""
    from nagmoe.config import config_from_dict

    mb = 1_000_000
    for call in (lambda: config_from_dict({"model": {"k" * mb: 1}}), lambda: load_config(None, ["k" * mb + "=1"]),
                 lambda: load_config(None, ["model." + "k" * mb + "=1"]),
                 lambda: config_from_dict({"model": {"d_model": "9x" * mb}})):
        text = message(call)
        assert text and len(text) < 600, len(text)
