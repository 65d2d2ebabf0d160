"""Opening the files a user gives as input (traces, scenarios, run records), with one set of checks.

An input must exist and be a regular file or a pipe (``<(zcat trace.jsonl.gz)``, ``/dev/stdin`` in a
pipeline); a folder or a device is refused. Whole-file reads are bounded, so that a pipe that never ends
(or ``/dev/zero`` behind a link) is refused instead of filling the memory. Every problem raises InputError
naming the file.
"""

from __future__ import annotations

import stat
from pathlib import Path

from prefixcache.core.errors import InputError

MiB = 2**20


def input_file(path: str | Path, what: str) -> Path:
    """``path`` after checking it can be read as an input (``what``: e.g. "trace file"). Changes nothing.

    Raises InputError: "no such <what>", a folder, a device, or a file that cannot be looked at."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise InputError(f"no such {what}", p) from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise InputError(f"cannot read {what}: {getattr(exc, 'strerror', None) or exc}", p) from None
    if stat.S_ISDIR(mode):
        raise InputError(f"is a folder, not a {what}", p)
    if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
        raise InputError(f"not a regular file or a pipe, so not a {what}", p)
    return p


def read_text(path: Path, what: str, limit: int) -> str:
    """The whole file as UTF-8 text, at most ``limit`` bytes. Changes nothing.

    Raises InputError when the file is longer, not UTF-8, or cannot be read."""
    chunks: list[bytes] = []
    size = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(MiB):
                size += len(chunk)
                if size > limit:
                    raise InputError(f"larger than {limit // MiB:,} MiB, too large for a {what}", path)
                chunks.append(chunk)
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror or exc}", path) from None
    return decode_utf8(b"".join(chunks), path, what)


def decode_utf8(data: bytes, path: Path, what: str) -> str:
    """``data`` decoded as UTF-8; InputError naming the line and column of the first bad byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise InputError(
            f"not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column}); not a {what}?", path, line
        ) from None
