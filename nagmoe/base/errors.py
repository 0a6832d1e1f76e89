"""User-facing errors: the CLI prints their message as one line and exits with code 2.

Every value shown in a message goes through `shown(value)`: a bounded repr (a few hundred characters, control
characters escaped) that never expands more of a container than it prints, so a YAML alias bomb or a 39 MB
string costs a few hundred characters, not the whole value. `one_line(message)` is the CLI's last guard: control
characters escaped, at most MAX_MESSAGE characters."""
from __future__ import annotations

import sys

SHOWN_CHARS = 200  # one value in a message
MAX_MESSAGE = 4000  # one whole error or warning line


class UserError(Exception):
    """Bad user input (config, paths, data): the message names what is wrong."""


def _escape(text: str) -> str:
    """Control characters (C0, DEL, C1, line and paragraph separators) as escapes: the message stays one line."""
    out = []
    for ch in text:
        code = ord(ch)
        if code < 0x20 or 0x7F <= code < 0xA0 or code in (0x2028, 0x2029):
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch, f"\\x{code:02x}" if code < 0x100
                                                                    else f"\\u{code:04x}"))
        else:
            out.append(ch)
    return "".join(out)


def _bounded(value, budget: int, depth: int) -> str:
    """repr(value) cut to about `budget` characters, built without visiting more than it shows."""
    if budget <= 0:
        return "..."
    if isinstance(value, str):
        return repr(value[:budget]) + ("..." if len(value) > budget else "")
    if isinstance(value, (bytes, bytearray)):
        return repr(bytes(value[:budget])) + ("..." if len(value) > budget else "")
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        if value.bit_length() > 3 * budget:  # str() of a huge int is quadratic and may be refused (4300 digits)
            return f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
        text = repr(value)
        return text if len(text) <= budget else text[:budget] + "..."
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if depth >= 4:
            return "[...]" if isinstance(value, list) else "{...}" if isinstance(value, dict) else "(...)"
        open_, close = {list: "[]", tuple: "()", dict: "{}"}.get(type(value), "{}")
        items = value.items() if isinstance(value, dict) else value
        parts, used = [], 2
        for i, item in enumerate(items):
            if used >= budget or i >= 16:
                parts.append(f"... ({len(value)} items)")
                break
            if isinstance(value, dict):
                text = f"{_bounded(item[0], budget - used, depth + 1)}: {_bounded(item[1], budget - used, depth + 1)}"
            else:
                text = _bounded(item, budget - used, depth + 1)
            parts.append(text)
            used += len(text) + 2
        return open_ + ", ".join(parts) + close
    try:
        text = repr(value)
    except Exception:  # a foreign object whose repr fails must not replace the error being reported
        text = f"<{type(value).__name__}>"
    return text[:budget] + ("..." if len(text) > budget else "")


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """`value` as a message shows it: a repr of at most about `limit` characters, control characters escaped."""
    text = _escape(_bounded(value, limit, 0))
    return text if len(text) <= limit + 40 else text[:limit] + "..."


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """A message as one bounded line (the CLI prints every error and warning through this)."""
    text = _escape(str(message))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def warn(message: str) -> None:
    """A warning on stderr, printed even with --quiet (warnings are never routine)."""
    print(f"[nagmoe] warning: {message}", file=sys.stderr, flush=True)
