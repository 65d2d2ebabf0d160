"""Writing output files without clobbering what the user pointed at.

* ``-`` is standard output.
* A symlink is followed: its target is written, the link stays a link.
* An existing non-regular file (a device such as /dev/stdout, a FIFO) is opened and written directly.
* Anything else (a regular file, or a new one) is written atomically: a temp file in the same folder,
  then renamed over the target (keeping an existing file's permission bits); a failed write leaves no
  temp file behind and the old file untouched. Missing parent folders are created.

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
    """An existing file that is not a regular file (device, FIFO, socket)."""
    try:
        mode = p.stat().st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


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


def check_output(path: str | Path, *, allow_stdout: bool = True) -> None:
    """Refuse, before any work, an output path that cannot be written. May create missing parent folders.

    Raises InputError naming the path and the reason."""
    if str(path) == STDOUT:
        if not allow_stdout:
            raise InputError("cannot be written to standard output (it writes files beside it); name a file", path)
        return
    shown = Path(path)
    target = _target(shown)
    if target.is_dir():
        raise InputError("cannot write: it is a directory", shown)
    if _special(target):
        if not os.access(target, os.W_OK):
            raise InputError("cannot write: permission denied", shown)
        return
    folder = _prepare_folder(target, shown)
    if target.exists() and not os.access(target, os.W_OK):
        raise InputError("cannot write: the file is read-only", shown)
    try:  # a real probe: catches read-only and pseudo file systems (e.g. /proc) that access() misses
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"cannot write in {folder}: {_reason(exc)}", shown) from None


def write_output(path: str | Path, data: str | bytes) -> str:
    """Write ``data`` to ``path`` by the rules in the module docstring. Returns where it went (for messages).

    Changes the file at ``path`` (or its symlink's target). Raises InputError when it cannot be written."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if str(path) == STDOUT:
        sys.stdout.flush()
        sys.stdout.buffer.write(raw)
        sys.stdout.buffer.flush()
        return "standard output"
    shown = Path(path)
    target = _target(shown)
    if target.is_dir():
        raise InputError("cannot write: it is a directory", shown)
    try:
        if _special(target):
            with open(target, "wb") as f:
                f.write(raw)
            return str(shown)
        folder = _prepare_folder(target, shown)
        mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else _default_mode()
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise InputError(f"cannot write: {_reason(exc)}", shown) from None
    return str(shown)


def _default_mode() -> int:
    """The permission bits a new file gets under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
