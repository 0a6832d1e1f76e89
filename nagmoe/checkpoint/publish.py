"""Publishing a finished save and pruning old checkpoints: the sequence both engines end a save with.

A step whose `step_N` exists and verifies is not saved again (`already_saved`, decided before anything is
written): the state at a step is the state at that step, and replacing a valid copy would open a window in
which a kill leaves none. Everything else is written under a fresh `step_N.tmp-<tag>` (a random tag, made with
mkdir by rank 0: a name someone planted in a shared checkpoints/ is never reused or followed, and cannot make a
save fail), files are fsync'ed while
hashing (by the rank that wrote them, for the torch engine: files.own_digests), the manifest goes in last, then one `os.rename` publishes the directory. Old checkpoints are removed
only after the new one is published (renamed to `*.del-<tag>` first, so a crash mid-delete leaves nothing
that looks like a checkpoint). Rank 0 alone runs this; the engines call it between their barriers.
"""
from __future__ import annotations

import errno
import os
import secrets
import shutil
from typing import Optional

from nagmoe.checkpoint.files import (CHECKPOINTS, MANIFEST, STATE, checkpoint_name, describe_files,
                                     is_valid_checkpoint, list_checkpoints, read_checkpoint_state, write_json)
from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import fsync_dir, make_temp_dir
from nagmoe.rundir.lease import other_holder, taken_over_message

TMP_MARK = ".tmp-"  # step_N.tmp-<tag>: files.TMP_DIR


def save_paths(run_dir: str, step: int) -> tuple[str, str]:
    """(checkpoints root, final step_N path)."""
    root = os.path.join(run_dir, CHECKPOINTS)
    return root, os.path.join(root, checkpoint_name(step))


def new_save_dir(root: str, final: str) -> tuple[str, str]:
    """(path, tag) of a fresh, empty `step_N.tmp-<random tag>` for this save (rank 0 only). Mode 0777 minus the
    umask, as os.makedirs gave it: the published step_N keeps the group's access of a shared run."""
    os.makedirs(root, exist_ok=True)
    tmp = make_temp_dir(root, os.path.basename(final) + TMP_MARK, mode=0o777)
    return tmp, tmp.rsplit(TMP_MARK, 1)[1]


def fresh_tag() -> str:
    """A tag for `.del-<tag>` names outside a save (recovery): random, like a save's."""
    return secrets.token_hex(6)


def already_saved(final: str) -> bool:
    """`final` (a step_N dir) exists and verifies: a save of that step is skipped."""
    return os.path.isdir(final) and is_valid_checkpoint(final)


def remove_dir(path: str, tag: str) -> None:
    """Rename out of the step_* namespace first, so a crash mid-delete never leaves a look-alike checkpoint."""
    doomed = f"{path}.del-{tag}"
    os.rename(path, doomed)
    _discard(doomed)


def _discard(doomed: str) -> None:
    if os.path.islink(doomed):  # a link someone planted at step_N: removed, never followed
        os.unlink(doomed)
    else:
        shutil.rmtree(doomed, ignore_errors=True)


def remove_replaced(final: str, tmp: str, tag: str) -> None:
    """Remove the invalid step_N `final` that the complete `tmp` is about to be renamed to (`remove_dir`), unless
    `tmp` is gone once `final` is out of the way and nothing took its place: then another writer had just renamed
    `tmp` to `final` (the take-over race: a publish and a resume's recovery of the same save), what was moved
    aside is that valid checkpoint, and it goes back. FileNotFoundError then."""
    doomed = f"{final}.del-{tag}"
    os.rename(final, doomed)
    if not os.path.lexists(tmp) and not os.path.lexists(final):
        os.rename(doomed, final)
        raise FileNotFoundError(errno.ENOENT, "renamed by another writer meanwhile", tmp)
    _discard(doomed)


def is_milestone(path: str) -> bool:
    """A checkpoint saved as a milestone (`train.keep_milestone_every_tokens`): never pruned."""
    try:
        return bool(read_checkpoint_state(path)["extra"].get("milestone", False))
    except UserError:  # an unreadable or foreign state.json (read_checkpoint_state's schema): not a milestone
        return False


def remove_leftovers(root: str) -> None:
    """Directories of crashed or failed saves and deletes (never a published checkpoint)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if ".tmp-" in name or ".del-" in name:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def prune(root: str, run_dir: str, new_step: int, keep: int, tag: str) -> None:
    """Keep the `keep` newest checkpoints up to `new_step`, and every milestone up to it; later ones belong to
    an abandoned timeline (the run resumed from an earlier step, so they were invalid or not chosen) and would
    shadow the new one."""
    published = list_checkpoints(run_dir)
    older = [(s, p) for s, p in published if s <= new_step]
    doomed = [p for s, p in published if s > new_step] + [p for _, p in older[:-keep] if not is_milestone(p)]
    for path in doomed:
        remove_dir(path, tag)
    remove_leftovers(root)


def _raise_if_moved(tmp: str, final: str, run_dir: str) -> None:
    """After an OSError between the fence and the rename: another writer moved this save's directory (or the
    invalid step_N it replaces) under us. That is the new lease holder when there is one (the take-over race,
    docs/decisions.md: its resume publishes a complete tmp dir itself), and the trainer stops with the fence's
    own line naming it; else a UserError saying so. Returns when `tmp` is still there and no one else holds the
    lease (an ordinary I/O failure: the caller re-raises it)."""
    holder = other_holder(run_dir)
    if holder is not None:
        raise UserError(taken_over_message(run_dir, holder)) from None
    if not os.path.isdir(tmp):
        raise UserError(f"checkpoint {shown(final)}: this save's directory {shown(tmp)} was moved by another process "
                        f"before it was published; this save published nothing (one writer per run dir)") from None


def publish(tmp: str, final: str, run_dir: str, state: dict, keep: int, tag: str,
            known: Optional[dict] = None) -> None:
    """`publish_dir`, then prune checkpoints/ to `keep`."""
    publish_dir(tmp, final, run_dir, state, tag, known)
    prune(os.path.dirname(final), run_dir, state["step"], keep, tag)


def publish_dir(tmp: str, final: str, run_dir: str, state: dict, tag: str, known: Optional[dict] = None) -> None:
    """Write state.json and the manifest into the complete `tmp`, rename it to `final` (over an invalid one there).
    When another writer moves `tmp` (or step_N) away meanwhile, a UserError: the fence's, naming the run dir's new
    holder, or one saying the directory was moved (`_raise_if_moved`). `known`: digests the writing ranks
    computed of their own files (files.own_digests); only the rest is hashed here."""
    try:
        write_json(os.path.join(tmp, STATE), state)
        files = describe_files(tmp, known)
        write_json(os.path.join(tmp, MANIFEST), {"format": state["format"], "step": state["step"], "files": files})
        fsync_dir(tmp)
        if os.path.lexists(final):  # also a dangling link planted there (exists() would say no, and rename fail)
            # a step_N that does not verify (a valid one is never re-saved: the engines skip the save). A kill
            # between these two renames leaves our complete tmp dir, which the next resume publishes
            # (nagmoe.checkpoint.resume.recover_unfinished).
            remove_replaced(final, tmp, tag)
        os.rename(tmp, final)
    except OSError:
        _raise_if_moved(tmp, final, run_dir)
        raise
    fsync_dir(os.path.dirname(final))
