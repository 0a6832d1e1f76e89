"""The one writer for every file nagmoe writes (issue 40): nothing is written through a name someone planted.

Run dirs, report dirs and data dirs live in shared, group-writable trees where another user can plant a symlink
or a hard link at a name we are about to write. So:

  * A whole file is written to a fresh temporary beside it, `.NAME.tmp-<random>`, created with
    O_CREAT|O_EXCL|O_NOFOLLOW (nothing there is opened, followed or truncated: a planted name is never ours),
    mode 0o666 minus the umask (as `open` would; `mkstemp`'s 0600 would lock the group out of shared runs),
    written, fsynced when durability matters, then `os.replace`d onto NAME: the rename replaces the directory
    entry, whatever link was there, and never writes into it.
    `atomic_writer(path)` (a file object: `json.dump`, `torch.save(obj, f)`, `fig.savefig(f, format="png")`),
    `write_atomic(path, data)`.
  * A file appended in place (`metrics.jsonl`) is opened with O_NOFOLLOW and refused unless it is a regular
    file with one link: `open_append(path)`; a symlink or a hard link there is a UserError naming the file
    (exit 2), and the other file is left as it was.
  * Temporary directories: `make_temp_dir(parent, prefix)` (tempfile.mkdtemp: a fresh random name, 0700);
    `create_fresh(path)` for a writer that names its file only once written.
The directories themselves (run dir, `checkpoints/`, `slurm/`, `figures/`, a data dir) may be symlinks: the rule
is about the files written inside them. No realpath checks (they race); no chmod of a path.

Reading files back that someone else may have written (run dirs, reports, caches, configs): UTF-8 always (never
the locale's encoding), and every way a crafted file can break a parser — invalid UTF-8, invalid JSON, 100,000
nested brackets (RecursionError), a 5,001-digit integer (ValueError), a wrong type — is a UserError naming the
file (and the field), shown through `errors.shown` so no message grows with the file.

Schemas are checked with `expect(obj, key, kinds, where)`: a small typed accessor rather than a schema library, so
each reader names exactly what it relies on."""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import stat
import tempfile
from typing import Any, IO, Iterator, Optional, Union

from nagmoe.base.errors import UserError, shown

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
TMP_MARK = ".tmp-"  # `.NAME.tmp-<random>`: what a crashed write leaves behind


def temp_name(path: str) -> str:
    """The fresh temporary beside `path`: `.NAME.tmp-<random hex>` in the same directory."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}{TMP_MARK}{secrets.token_hex(6)}")


def create_fresh(path: str, mode: int = 0o666) -> tuple[int, str]:
    """(descriptor, name) of a fresh temporary beside `path`, for a writer that picks the final name later (a
    shard named by its hash): the caller writes, then `os.replace`s or unlinks it."""
    for _ in range(8):  # a clash with a random name is someone's plant or a one-in-2^48 accident: draw again
        tmp = temp_name(path)
        try:
            return os.open(tmp, _CREATE, mode), tmp
        except FileExistsError:
            continue
    raise UserError(f"{os.path.dirname(path) or '.'}: cannot create a fresh temporary file there")


def fsync_dir(folder: str) -> None:
    fd = os.open(folder or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str, binary: bool = False, durable: bool = False, mode: int = 0o666,
                  encoding: str = "utf-8") -> Iterator[IO]:
    """Yields a file object on a fresh temporary; on a clean exit it replaces `path` (module docstring), else
    the temporary is removed and `path` is untouched. `durable`: fsync the file and the directory."""
    fd, tmp = create_fresh(path, mode)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": encoding})) as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path))


def write_atomic(path: str, data: Union[str, bytes], durable: bool = False, mode: int = 0o666) -> None:
    """`data` into `path` through a fresh temporary (module docstring)."""
    with atomic_writer(path, binary=isinstance(data, bytes), durable=durable, mode=mode) as f:
        f.write(data)


def open_append(path: str, encoding: str = "utf-8") -> IO:
    """`path` opened for appending in place, created if missing; a symlink, a hard link or anything but a regular
    file there is a UserError (exit 2) naming it, and nothing is written."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path}: is a symbolic link; nagmoe does not write through links") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"has {st.st_nlink} hard links"
        raise UserError(f"{path}: {what}; nagmoe does not write into a file shared with another name")
    return os.fdopen(fd, "a", encoding=encoding)


def make_temp_dir(parent: str, prefix: str, mode: Optional[int] = None) -> str:
    """A fresh directory `PREFIX<random>` inside `parent`, nobody else's: mode 0700 (tempfile.mkdtemp), or `mode`
    minus the umask for one that is published as it is (a checkpoint's `step_N.tmp-<random>`, renamed to
    `step_N`: 0700 would lock the group out of a shared run's checkpoints). mkdir never follows a planted name."""
    if mode is None:
        return tempfile.mkdtemp(prefix=prefix, dir=parent)
    for _ in range(8):  # as create_fresh: a clash is a plant or an accident, draw again
        path = os.path.join(parent, f"{prefix}{secrets.token_hex(6)}")
        try:
            os.mkdir(path, mode)
            return path
        except FileExistsError:
            continue
    raise UserError(f"{parent or '.'}: cannot create a fresh temporary directory there")


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
