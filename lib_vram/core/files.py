"""Writing a user's output without ever leaving a half-written file or replacing one by accident."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

_UMASK: int | None = None


def _umask() -> int:
    """The process umask, read once (``os.umask`` can only be read by setting it, which would race
    with other threads if done per write)."""
    global _UMASK
    if _UMASK is None:
        _UMASK = os.umask(0o022)
        os.umask(_UMASK)
    return _UMASK


def write_atomic(dst: Path | str, fill: Callable[[Path], None], *, overwrite: bool = False) -> None:
    """Have ``fill(tmp)`` write a temporary file beside ``dst``, flush it to disk, then move it to
    ``dst``.

    Without ``overwrite`` an existing ``dst`` is never replaced (``FileExistsError``, also when it
    appeared meanwhile: the final step is a hard link, which fails on an existing name). Whatever
    goes wrong (Ctrl-C included), the temporary file is removed and ``dst`` is untouched.
    """
    dst = Path(dst)
    fd, name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".part", dir=dst.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        fill(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        if overwrite:
            os.replace(tmp, dst)
            return
        try:
            os.link(tmp, dst)
        except FileExistsError:
            raise FileExistsError(f"{dst} exists; not replaced") from None
        except OSError:  # no hard links on this file system
            if os.path.lexists(dst):
                raise FileExistsError(f"{dst} exists; not replaced") from None
            os.replace(tmp, dst)
            return
        tmp.unlink()
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
