"""Publishing a finished save and pruning old checkpoints: the sequence both engines end a save with.

A step whose `step_N` exists and verifies is not saved again (`already_saved`, decided before anything is
written): the state at a step is the state at that step, and replacing a valid copy would open a window in
which a kill leaves none. Everything else is written under a fresh `step_N.tmp-<tag>` (a random tag, made with
mkdir by rank 0: a name someone planted in a shared checkpoints/ is never reused or followed, and cannot make a
save fail), files are fsync'ed while
hashing, the manifest goes in last, then one `os.rename` publishes the directory. Old checkpoints are removed
only after the new one is published (renamed to `*.del-<tag>` first, so a crash mid-delete leaves nothing
that looks like a checkpoint). Rank 0 alone runs this; the engines call it between their barriers.
"""
from __future__ import annotations

import os
import secrets
import shutil

from nagmoe.checkpoint.files import (CHECKPOINTS, MANIFEST, STATE, checkpoint_name, describe_files,
                                     is_valid_checkpoint, list_checkpoints, read_checkpoint_state, write_json)
from nagmoe.base.errors import UserError
from nagmoe.base.files import fsync_dir, make_temp_dir

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
    if os.path.islink(doomed):  # a link someone planted at step_N: removed, never followed
        os.unlink(doomed)
    else:
        shutil.rmtree(doomed, ignore_errors=True)


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


def publish(tmp: str, final: str, run_dir: str, state: dict, keep: int, tag: str) -> None:
    """Write state.json and the manifest into the complete `tmp`, rename it to `final`, prune to `keep`."""
    root = os.path.dirname(final)
    write_json(os.path.join(tmp, STATE), state)
    files = describe_files(tmp)
    write_json(os.path.join(tmp, MANIFEST), {"format": state["format"], "step": state["step"], "files": files})
    fsync_dir(tmp)
    if os.path.lexists(final):  # also a dangling link planted there (exists() would say no, and rename fail)
        # a step_N that does not verify (a valid one is never re-saved: the engines skip the save). A kill
        # between these two renames leaves our complete tmp dir, which the next resume publishes
        # (nagmoe.checkpoint.resume.recover_unfinished).
        remove_dir(final, tag)
    os.rename(tmp, final)
    fsync_dir(root)
    prune(root, run_dir, state["step"], keep, tag)
