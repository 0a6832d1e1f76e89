"""`nagmoe.flops`, a contract name (DESIGN.md: `nagmoe.flops.flops_per_token`, `nagmoe.flops.param_counts`), is the
accounting module nagmoe/config/flops.py under its public name: the same module object, not a copy, so every name
(and a test's monkeypatch) is the same through either. The package's own code imports nagmoe.config.flops."""
import sys

from nagmoe.config import flops as _accounting

sys.modules[__name__] = _accounting
