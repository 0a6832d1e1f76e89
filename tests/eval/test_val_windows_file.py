"""RUN_DIR/eval_windows.json (issue 66, nagmoe/eval/val_windows.py) read back as a file someone else may have
written: a well-formed file round-trips exactly (ids, float64 nats to the last bit, bytes, tokens, step, sample);
every malformed one (not JSON, another format or version, a missing or mistyped field, columns of other lengths,
ids not ascending or past split_windows, negative or non-finite or boolean numbers, integers past int64, a file
past MAX_FILE_BYTES, a sample fingerprint that does not match, a link or not a regular file) is a UserError whose
message is one bounded line naming the file; no file is None."""
import json
import math
import os

import numpy as np
import pytest

from nagmoe.base.errors import UserError, shown
from nagmoe.data.eval_sample import eval_window_ids, sample_fingerprint
from nagmoe.eval import val_windows
from nagmoe.eval.val_windows import WindowLosses, read_window_losses, write_window_losses
from nagmoe.rundir.names import EVAL_WINDOWS_FILE

SPLIT_WINDOWS, SEQ_LEN = 1000, 64


def well_formed() -> WindowLosses:
    ids = eval_window_ids(SPLIT_WINDOWS, 37 * SEQ_LEN, SEQ_LEN, "strided")
    rng = np.random.default_rng(0)
    nats = rng.uniform(0.0, 400.0, len(ids))
    nats[:4] = [0.0, 1 / 3, 5e-324, math.pi * 1e17]  # zero, a repeating binary fraction, a subnormal, a large one
    return WindowLosses("0123456789abcdef", SEQ_LEN, "strided", SPLIT_WINDOWS, ids, nats,
                        rng.integers(0, 300, len(ids)), rng.integers(0, 65, len(ids)), step=7)


def test_no_file_is_none(tmp_path):
    assert read_window_losses(str(tmp_path)) is None


def test_a_well_formed_file_round_trips_exactly(tmp_path):
    want = well_formed()
    path = write_window_losses(str(tmp_path), want)
    assert path == str(tmp_path / EVAL_WINDOWS_FILE)
    got = read_window_losses(str(tmp_path))
    for name in ("data_fingerprint", "seq_len", "sample", "split_windows", "step", "split"):
        assert getattr(got, name) == getattr(want, name), name
    for name, dtype in (("window_ids", np.int64), ("nats", np.float64), ("bytes", np.int64), ("tokens", np.int64)):
        assert getattr(got, name).dtype == dtype, name
        assert getattr(got, name).tobytes() == np.asarray(getattr(want, name), dtype=dtype).tobytes(), name  # bitwise
    assert got.fingerprint == want.fingerprint == json.loads((tmp_path / EVAL_WINDOWS_FILE).read_text())[
        "sample_fingerprint"]
    assert got.bpb == want.bpb
    before = (tmp_path / EVAL_WINDOWS_FILE).read_bytes()
    write_window_losses(str(tmp_path), got)  # written again from what was read: the same bytes
    assert (tmp_path / EVAL_WINDOWS_FILE).read_bytes() == before
    # a sample of one window, a "first" sample, step null
    one = WindowLosses("f" * 16, 8, "first", 1, np.zeros(1, np.int64), np.array([2.5]), np.array([3]),
                       np.array([1]), step=None)
    write_window_losses(str(tmp_path), one)
    got = read_window_losses(str(tmp_path))
    assert (got.sample, got.step, got.window_ids.tolist(), got.nats.tolist()) == ("first", None, [0], [2.5])


# ----------------------------------------------------------------------------------------------------------
# Malformed files
# ----------------------------------------------------------------------------------------------------------
def _set(key, value):
    def change(obj):
        obj[key] = value
    return change


def _drop(key):
    def change(obj):
        del obj[key]
    return change


def _item(key, i, value):
    def change(obj):
        obj[key][i] = value
    return change


def _swap_ids(obj):
    obj["window_ids"][3], obj["window_ids"][4] = obj["window_ids"][4], obj["window_ids"][3]
    _refingerprint(obj)


def _repeat_id(obj):
    obj["window_ids"][4] = obj["window_ids"][3]
    _refingerprint(obj)


def _past_the_split(obj):
    obj["window_ids"][-1] = SPLIT_WINDOWS
    _refingerprint(obj)


def _split_shrunk(obj):
    obj["split_windows"] = obj["window_ids"][-1]  # the last id is not below it


def _refingerprint(obj):
    """Recompute sample_fingerprint, so the check that fires is the one the case is about."""
    ids = obj["window_ids"]
    if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 63 for v in ids):
        obj["sample_fingerprint"] = sample_fingerprint(obj["data_fingerprint"], obj["seq_len"], np.array(ids))


def _shorter(key):
    def change(obj):
        obj[key] = obj[key][:-1]
    return change


def _no_windows(obj):
    for key in ("window_ids", "nats", "bytes", "tokens"):
        obj[key] = []


# (what is wrong, change to the well-formed object, what the message must also say)
OBJECT_CASES = [
    ("format", _set("format", "nagmoe.something_else"), "format"),
    ("no format", _drop("format"), "format"),
    ("version", _set("version", 2), "version"),
    ("version as a string", _set("version", "1"), "version"),
    ("version as true", _set("version", True), "version"),
    ("version as a float", _set("version", 1.0), "version"),
    ("no nats", _drop("nats"), "nats"),
    ("no data fingerprint", _drop("data_fingerprint"), "data_fingerprint"),
    ("seq_len a string", _set("seq_len", "64"), "seq_len"),
    ("seq_len true", _set("seq_len", True), "seq_len"),
    ("seq_len 0", _set("seq_len", 0), "seq_len"),
    ("split_windows negative", _set("split_windows", -1), "split_windows"),
    ("split_windows a float", _set("split_windows", 1000.0), "split_windows"),
    ("a long data fingerprint", _set("data_fingerprint", "0" * 100_000), "data_fingerprint"),
    ("sample unknown", _set("sample", "random" * 10_000), "sample"),
    ("step a string", _set("step", "7"), "step"),
    ("step true", _set("step", True), "step"),
    ("split a list", _set("split", ["val"]), "split"),
    ("window_ids an object", _set("window_ids", {"0": 1}), "window_ids"),
    ("nats shorter", _shorter("nats"), "nats"),
    ("bytes shorter", _shorter("bytes"), "bytes"),
    ("tokens shorter", _shorter("tokens"), "tokens"),
    ("no windows", _no_windows, "windows"),
    ("ids not ascending", _swap_ids, "window_ids"),
    ("an id twice", _repeat_id, "window_ids"),
    ("an id = split_windows", _past_the_split, "split_windows"),
    ("split_windows below the ids", _split_shrunk, "split_windows"),
    ("a negative id", _item("window_ids", 0, -1), "window_ids[0]"),
    ("a float id", _item("window_ids", 2, 5.0), "window_ids[2]"),
    ("a string id", _item("window_ids", 2, "5"), "window_ids[2]"),
    ("an id past int64", _item("window_ids", 2, 10 ** 30), "window_ids[2]"),
    ("bytes past int64", _item("bytes", 5, 2 ** 63), "bytes[5]"),
    ("tokens past int64", _item("tokens", 5, -(2 ** 70)), "tokens[5]"),
    ("negative bytes", _item("bytes", 5, -1), "bytes[5]"),
    ("negative tokens", _item("tokens", 6, -3), "tokens[6]"),
    ("negative nats", _item("nats", 7, -0.5), "nats[7]"),
    ("NaN nats", _item("nats", 8, float("nan")), "nats[8]"),
    ("infinite nats", _item("nats", 8, float("inf")), "nats[8]"),
    ("-infinite nats", _item("nats", 8, float("-inf")), "nats[8]"),
    ("bool nats", _item("nats", 9, False), "nats[9]"),
    ("bool bytes", _item("bytes", 9, True), "bytes[9]"),
    ("bool tokens", _item("tokens", 9, True), "tokens[9]"),
    ("null tokens", _item("tokens", 9, None), "tokens[9]"),
    ("a float in bytes", _item("bytes", 9, 3.5), "bytes[9]"),
    ("a list in nats", _item("nats", 1, [1.0] * 10_000), "nats[1]"),
    ("wrong sample fingerprint", _set("sample_fingerprint", "0" * 16), "sample_fingerprint"),
    ("sample fingerprint of other ids", _item("window_ids", 0, 1), "sample_fingerprint"),
    ("sample fingerprint of another seq_len", _set("seq_len", 128), "sample_fingerprint"),
    ("sample fingerprint of other data", _set("data_fingerprint", "fedcba9876543210"), "sample_fingerprint"),
]


def assert_refused(run_dir, *fragments):
    """read_window_losses raises a UserError: one line, bounded, naming the file (and `fragments`)."""
    path = os.path.join(run_dir, EVAL_WINDOWS_FILE)
    with pytest.raises(UserError) as e:
        read_window_losses(run_dir)
    message = str(e.value)
    assert "\n" not in message and "\r" not in message, message
    assert len(message) <= len(shown(path)) + 300, message[:2000]
    assert shown(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize("what,change,fragment", OBJECT_CASES, ids=[c[0] for c in OBJECT_CASES])
def test_a_malformed_field_is_a_one_line_user_error_naming_the_file(tmp_path, what, change, fragment):
    obj = well_formed().to_json()
    change(obj)
    (tmp_path / EVAL_WINDOWS_FILE).write_text(json.dumps(obj))  # NaN / Infinity as Python's json writes them
    assert_refused(str(tmp_path), fragment)


TEXT_CASES = {
    "empty": b"",
    "not JSON": b'{"format": "nagmoe.eval_windows", "version": 1, ',
    "not UTF-8": b'{"format": "\xff\xfe"}',
    "a list": b"[1, 2, 3]",
    "a string": b'"nagmoe.eval_windows"',
    "null": b"null",
    "nested too deeply": b"[" * 200_000 + b"]" * 200_000,
    "an integer of 5000 digits": b'{"format": "nagmoe.eval_windows", "version": 1' + b"0" * 5000 + b"}",
    "NUL bytes": b"\x00" * 1000,
}


@pytest.mark.parametrize("what", list(TEXT_CASES))
def test_a_file_that_is_not_our_json_is_a_one_line_user_error(tmp_path, what):
    (tmp_path / EVAL_WINDOWS_FILE).write_bytes(TEXT_CASES[what])
    assert_refused(str(tmp_path))


def test_a_file_past_max_file_bytes_is_refused_unread(tmp_path, monkeypatch):
    """A sparse file one byte past MAX_FILE_BYTES (256 MiB of size, no blocks): refused by its size, and fast."""
    path = tmp_path / EVAL_WINDOWS_FILE
    write_window_losses(str(tmp_path), well_formed())
    with open(path, "r+b") as f:
        f.truncate(val_windows.MAX_FILE_BYTES + 1)
    assert os.path.getsize(path) == val_windows.MAX_FILE_BYTES + 1
    reads = []
    monkeypatch.setattr(val_windows, "read_json", lambda p: reads.append(p))
    assert_refused(str(tmp_path), f"{val_windows.MAX_FILE_BYTES:,}")
    assert not reads  # refused before any read
    monkeypatch.undo()
    # the bound itself, on a well-formed file of S bytes: read at a limit of S, refused at S - 1
    write_window_losses(str(tmp_path), well_formed())
    size = os.path.getsize(path)
    monkeypatch.setattr(val_windows, "MAX_FILE_BYTES", size)
    assert read_window_losses(str(tmp_path)) is not None
    monkeypatch.setattr(val_windows, "MAX_FILE_BYTES", size - 1)
    assert_refused(str(tmp_path), f"{size:,} bytes")


def test_more_windows_than_max_windows_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(val_windows, "MAX_WINDOWS", 10)
    write_window_losses(str(tmp_path), well_formed())  # 37 windows
    assert_refused(str(tmp_path), "37 windows")


def test_a_link_or_not_a_regular_file_is_refused(tmp_path):
    good = tmp_path / "elsewhere"
    good.mkdir()
    write_window_losses(str(good), well_formed())
    assert read_window_losses(str(good)) is not None
    for kind in ("symlink", "dangling symlink", "directory", "fifo"):
        run_dir = tmp_path / kind.replace(" ", "_")
        run_dir.mkdir()
        path = run_dir / EVAL_WINDOWS_FILE
        if kind == "symlink":
            os.symlink(good / EVAL_WINDOWS_FILE, path)
        elif kind == "dangling symlink":
            os.symlink(tmp_path / "nowhere", path)
        elif kind == "directory":
            path.mkdir()
        else:
            os.mkfifo(path)  # never opened: it would block
        assert_refused(str(run_dir), "not a regular file")
