"""The benchmarks' one way out: the result as JSON on stdout and, with `--out FILE`, in that file too."""
from __future__ import annotations

import json
from typing import Optional


def emit_json(result: dict, out: Optional[str] = None, indent: int = 2) -> None:
    text = json.dumps(result, indent=indent)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
