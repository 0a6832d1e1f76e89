"""What a user may allow a trainer to do to a run dir, one flag per meaning (issue 41: the old `--force` meant
all three at once, and a rendered job script carried it into every requeue):

  --accept-config-change  resume although the resumable config keys differ (train, launch, experiment). The
                          only one a rendered job script may carry, and then with `--config-sha256` of the
                          submitted config: `train` refuses another config, so the acceptance is tied to it.
  --take-over             take a LIVE lease from another trainer (train only: a requeue must never do it).
  --start-over            start over a run dir whose checkpoints all fail verification (train only).

Plain `--force` is refused (exit 2) with a line naming these flags: silently mapping it to one meaning would
keep old scripts running with a meaning their author did not pick.
"""
from __future__ import annotations

import argparse
import hashlib
import re

from nagmoe.base.errors import UserError, shown

SHA256 = re.compile(r"[0-9a-f]{64}")
FORCE_GONE = ("--force was split (issue 41): pass --accept-config-change to resume with a changed config{train}")
TRAIN_EXTRA = ", --take-over to take a live run dir from another trainer, --start-over to start over a run dir " \
              "whose checkpoints all fail verification"


def add_force_refusal(p) -> None:
    """A hidden --force, so its use is one line naming the new flags rather than argparse's 'unrecognized'."""
    p.add_argument("--force", action="store_true", help=argparse.SUPPRESS)


def add_accept_config_change(p) -> None:
    p.add_argument("--accept-config-change", action="store_true",
                   help="resume although the config differs beyond the schedule-length and layout keys")
    add_force_refusal(p)


def add_train_permissions(p) -> None:
    add_accept_config_change(p)
    p.add_argument("--take-over", action="store_true",
                   help="take the run dir's lease from a trainer that is still alive (it stops at its next write)")
    p.add_argument("--start-over", action="store_true",
                   help="start over a run dir whose checkpoints all fail verification")
    p.add_argument("--config-sha256", default=None, metavar="HEX",
                   help="refuse unless the --config file has this sha256 (rendered job scripts pass it)")


def refuse_force(args, train: bool = False) -> None:
    if getattr(args, "force", False):
        raise UserError(FORCE_GONE.format(train=TRAIN_EXTRA if train else
                                          " (taking over a live run dir or starting over is `nagmoe train "
                                          "--take-over` / `--start-over`, never a job script's)"))


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_config_sha256(path: str, expected) -> None:
    """The config file must be the submitted one: --config-sha256 ties a job's acceptance to it."""
    if expected is None:
        return
    if not SHA256.fullmatch(expected):
        raise UserError(f"--config-sha256 {shown(expected, 80)}: expected 64 lowercase hex digits")
    try:
        actual = file_sha256(path)
    except OSError as e:
        raise UserError(f"--config {shown(path)}: cannot read it ({e.strerror or type(e).__name__})") from None
    if actual != expected:
        raise UserError(f"--config {shown(path)}: its sha256 is {actual[:12]}..., not the submitted config's "
                        f"{expected[:12]}... (--config-sha256); the file changed since submission")


def script_train_args(config_sha256=None, accept_config_change: bool = False) -> str:
    """The `nagmoe train` flags a rendered job script carries: never --take-over or --start-over."""
    if accept_config_change and config_sha256 is None:
        raise ValueError("--accept-config-change in a job script needs the submitted config's sha256")
    out = f" --config-sha256 {config_sha256}" if config_sha256 else ""
    return out + (" --accept-config-change" if accept_config_change else "")
