"""Writing output files without clobbering what the user pointed at.

* ``-`` is standard output.
* A symlink is followed: its target is written, the link stays a link.
* An existing non-regular file (a device such as /dev/null or /dev/stdout, a FIFO) is opened and written
  directly, never replaced.
* Anything else (a regular file, or a new one) is written atomically: a temp file in the same folder,
  flushed to disk, then renamed over the target (keeping an existing file's permission bits); a failed
  write leaves no temp file behind and the old file untouched. Missing parent folders are created.

A Markdown report writes PNG files beside itself, so it needs a regular file in a writable folder: ``-``
and devices are refused for it (``files_beside``).

:func:`check_output` runs the same checks before a long computation, so that an unwritable place (a
directory, a path under a regular file, a read-only or pseudo file system) is refused in one line up front.
Every problem raises InputError naming the path.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path

from prefixcache.core.errors import InputError

STDOUT = "-"


def _target(path: Path) -> Path:
    """The file a write to ``path`` lands in: symlinks followed (also dangling ones)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _special(p: Path) -> bool:
    """An existing file that is not a regular file or a folder (device, FIFO, socket)."""
    try:
        mode = p.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _reason(exc: OSError | ValueError) -> str:
    """An OSError's own words ("Permission denied"); a ValueError's message (a NUL byte in a path)."""
    return getattr(exc, "strerror", None) or str(exc)


def _prepare_folder(path: Path, shown: Path) -> Path:
    """Create the folder ``path`` goes in (like mkdir -p); raise InputError when that is impossible."""
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError(f"cannot write: {folder} is not a folder", shown) from None
    except OSError as exc:
        raise InputError(f"cannot create its folder {folder}: {_reason(exc)}", shown) from None
    if not folder.is_dir():
        raise InputError(f"cannot write: {folder} is not a folder", shown)
    return folder


def _probe(folder: Path, shown: Path) -> None:
    """Create and drop a temp file in ``folder``: catches read-only and pseudo file systems (e.g. /proc)
    that ``os.access`` misses."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"cannot write in {folder}: {_reason(exc)}", shown) from None


def _check(shown: Path, files_beside: bool) -> None:
    target = _target(shown)
    if target.is_dir():
        raise InputError("cannot write: it is a directory", shown)
    if _special(target):
        if files_beside:
            raise InputError("not a regular file; this output writes files beside it, so name a file", shown)
        if not os.access(target, os.W_OK):
            raise InputError("cannot write: permission denied", shown)
        return
    folder = _prepare_folder(target, shown)
    if target.exists() and not os.access(target, os.W_OK):
        raise InputError("cannot write: the file is read-only", shown)
    _probe(folder, shown)
    if files_beside and target != shown:  # a symlink: the files beside go next to the link
        _probe(_prepare_folder(shown, shown), shown)


def check_output(path: str | Path, *, files_beside: bool = False) -> None:
    """Refuse, before any work, an output path that cannot be written. May create missing parent folders.

    ``files_beside``: the output also writes files next to ``path`` (a Markdown report's PNGs), so it must
    be a regular file and its folder writable. Raises InputError naming the path and the reason."""
    if str(path) == STDOUT:
        if files_beside:
            raise InputError("cannot be written to standard output (it writes files beside it); name a file", path)
        return
    shown = Path(path)
    try:
        _check(shown, files_beside)
    except InputError:
        raise
    except (OSError, ValueError) as exc:  # a symlink loop, a name too long, a NUL byte in the name
        raise InputError(f"cannot write: {_reason(exc)}", shown) from None


def _write_stdout(raw: bytes) -> str:
    try:
        sys.stdout.flush()
        sys.stdout.buffer.write(raw)
        sys.stdout.buffer.flush()
    except BrokenPipeError:
        raise  # the reader went away (`| head`): the CLI exits quietly
    except OSError as exc:
        raise InputError(f"cannot write to standard output: {_reason(exc)}") from None
    return "standard output"


def _write_file(shown: Path, raw: bytes) -> None:
    target = _target(shown)
    if target.is_dir():
        raise InputError("cannot write: it is a directory", shown)
    if _special(target):
        with open(target, "wb") as f:
            f.write(raw)
        return
    folder = _prepare_folder(target, shown)
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else _default_mode()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())  # the rename must not expose a file whose data is not on disk yet
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_output(path: str | Path, data: str | bytes) -> str:
    """Write ``data`` to ``path`` by the rules in the module docstring. Returns where it went (for messages).

    Changes the file at ``path`` (or its symlink's target). Raises InputError when it cannot be written."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if str(path) == STDOUT:
        return _write_stdout(raw)
    shown = Path(path)
    try:
        _write_file(shown, raw)
    except InputError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise InputError(f"cannot write: {_reason(exc)}", shown) from None
    return str(shown)


def _default_mode() -> int:
    """The permission bits a new file gets under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
