"""Reading files back that someone else may have written (run dirs, reports, caches, configs): UTF-8 always (never
the locale's encoding), and every way a crafted file can break a parser — invalid UTF-8, invalid JSON, 100,000
nested brackets (RecursionError), a 5,001-digit integer (ValueError), a wrong type — is a UserError naming the
file (and the field), shown through `errors.shown` so no message grows with the file.

Schemas are checked with `expect(obj, key, kinds, where)`: a small typed accessor rather than a schema library, so
each reader names exactly what it relies on."""
from __future__ import annotations

import json
import math
from typing import Any

from nagmoe.errors import UserError, shown

NUMBER = (int, float)


def read_text(path: str) -> str:
    """The file's text as UTF-8; unreadable or not UTF-8 is a UserError naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(f"{shown(path)}: cannot read it ({e.strerror or type(e).__name__})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{shown(path)}: not UTF-8 text (byte {e.start})") from None


def loads_json(text: str, where: str) -> Any:
    """json.loads with every failure a UserError naming `where` (a path, or `path line N`)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and "Exceeds the limit (4300 digits)" of int()
        raise UserError(f"{where}: not valid JSON ({shown(str(e).splitlines()[0] if str(e) else e, 120)})") \
            from None


def read_json(path: str) -> Any:
    return loads_json(read_text(path), shown(path))


def expect_object(obj: Any, where: str) -> dict:
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def expect(obj: dict, key: str, kinds, where: str, required: bool = True, default: Any = None) -> Any:
    """obj[key] checked against `kinds` (a type or tuple; bool never counts as a number; floats must be finite)."""
    if key not in obj:
        if required:
            raise UserError(f"{where}: missing field {key!r}")
        return default
    value = obj[key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    is_bool_as_number = isinstance(value, bool) and bool not in kinds
    if is_bool_as_number or not isinstance(value, kinds) or (isinstance(value, float) and not math.isfinite(value)):
        names = " or ".join(k.__name__ for k in kinds)
        raise UserError(f"{where}: field {key!r} must be {names}, got {shown(value, 80)}")
    return value
