"""Fuzzed configs (issue 16, item 3): for every config field, hypothesis generates values that are invalid
for it (wrong type, NaN/Inf, out of range, not one of the choices); loading must raise ConfigError with one
line naming the field, never another exception. In-process for speed; a handful through the real CLI."""
import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nagmoe.config import (CHOICES, NON_NEGATIVE, POSITIVE, Config, ConfigError, config_from_dict, load_config,
                           to_dict)
from nagmoe.config.schema import TRISTATE_KEYS
from cli_process import ENV, REPO

TINY = os.path.join(REPO, "configs", "tiny.yaml")
BOOL_WORDS = {"true", "yes", "on", "1", "false", "no", "off", "0"}
# float fields with an allowed interval: (low, high, low_closed, high_closed)
RANGES = {
    "data.val_fraction": (0.0, 1.0, False, False), "model.mod.skip_rate": (0.0, 1.0, True, False),
    "model.attention.rope_fraction": (0.0, 1.0, True, True), "train.warmdown_frac": (0.0, 1.0, True, True),
    "train.final_lr_frac": (0.0, 1.0, True, True), "train.gate_collapse_fraction": (0.0, 1.0, True, True),
    "train.muon_momentum": (0.0, 1.0, True, False), "model.nag.beta_init": (0.0, math.inf, False, False),
}
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def leaf_fields(cls=Config, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from leaf_fields(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


FIELDS = dict(leaf_fields())
BASE = to_dict(load_config(TINY))

_containers = st.one_of(st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                             min_size=1, max_size=2))
_words = st.text(alphabet="qxzw!?#", min_size=1, max_size=6)  # never a number, none, nan or a boolean


def invalid_values(key: str, tp) -> st.SearchStrategy:
    base = tp
    if typing.get_origin(tp) is typing.Union:
        base = next(a for a in typing.get_args(tp) if a is not type(None))
    options = [_containers]
    if base is bool:
        options += [st.integers(), st.floats(), st.text(max_size=5).filter(lambda s: s.lower() not in BOOL_WORDS)]
    elif base is int:
        options += [st.booleans(), _words,
                    st.floats().filter(lambda f: not (math.isfinite(f) and f.is_integer()))]
    elif base is float:
        options += [st.booleans(), _words, st.sampled_from([math.nan, math.inf, -math.inf, "nan", "-inf", ".inf"])]
    elif base is str and key not in TRISTATE_KEYS:  # auto | true | false keys read YAML booleans
        options += [st.booleans()]
    if key in CHOICES:
        boolean = key in TRISTATE_KEYS
        options.append(st.text(max_size=8).filter(
            lambda s: s not in CHOICES[key] and not (boolean and s.lower() in BOOL_WORDS)))
    number = st.integers if base is int else (lambda **kw: st.floats(allow_nan=False, allow_infinity=False, **kw))
    if key in POSITIVE:
        options.append(number(max_value=0))
    if key in NON_NEGATIVE:
        options.append(number(max_value=-1) if base is int else number(max_value=-1e-9))
    if key in RANGES:
        low, high, low_closed, high_closed = RANGES[key]
        options.append(st.floats(max_value=low, exclude_max=low_closed, allow_nan=False, allow_infinity=False))
        if math.isfinite(high):
            options.append(st.floats(min_value=high, exclude_min=high_closed, allow_nan=False,
                                     allow_infinity=False))
    return st.one_of(options)


def with_value(key: str, value) -> dict:
    data = {section: dict(values) for section, values in BASE.items()}
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node[part] = dict(node[part])
        node = node[part]
    node[leaf] = value
    return data


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_every_field_rejects_invalid_values(key):
    @SETTINGS
    @given(value=invalid_values(key, FIELDS[key]))
    def check(value):
        with pytest.raises(ConfigError) as err:
            config_from_dict(with_value(key, value))
        message = str(err.value)
        assert "\n" not in message
        assert key in message or key.rsplit(".", 1)[-1] in message, (key, value, message)

    check()


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(text=st.text(max_size=80))
def test_arbitrary_yaml_text_is_a_config_or_a_config_error(text):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "c.yaml")
        with open(path, "w") as f:
            f.write(text)
        try:
            load_config(path)
        except ConfigError as e:
            assert "\n" not in str(e)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(sections=st.dictionaries(st.sampled_from(["model", "train", "data", "log", "parallel", "extra"]),
                                st.one_of(st.none(), st.integers(), st.text(max_size=4), _containers),
                                max_size=3))
def test_wrong_section_shapes(sections):
    try:
        config_from_dict(sections)
    except ConfigError as e:
        assert "\n" not in str(e)


CLI_CASES = [
    ("train.lr_matrix=nan", "train.lr_matrix"),
    ("model.d_model=-4", "model.d_model"),
    ("train.nonfinite=maybe", "train.nonfinite"),
    ("log.wandb=[1, 2]", "log.wandb"),
    ("train.gate_collapse_fraction=1.5", "train.gate_collapse_fraction"),
]


def test_invalid_overrides_through_the_cli():
    """The real CLI (`nagmoe config`), five processes at once: exit 2, one line naming the key."""
    procs = [(key, subprocess.Popen([sys.executable, "-m", "nagmoe", "config", "--config", TINY, override],
                                    cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)) for override, key in CLI_CASES]
    for key, proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (key, err)
        assert "Traceback" not in err and out == ""
        assert err.count("\n") == 1 and key in err, err
