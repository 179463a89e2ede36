"""Errors a user can act on. The CLI prints their message without a traceback."""

from __future__ import annotations

import errno
import os


class TallowError(Exception):
    """Base of every error whose message alone tells the user what is wrong."""


class ModelSourceError(TallowError):
    """The model to compile cannot be found or read (folder, hub id, GGUF file)."""


class ArtifactError(TallowError):
    """An artifact folder that is missing, damaged, or built for something else."""


class TargetError(TallowError):
    """A target or dtype the compiler or the device cannot handle."""


class DiskFullError(TallowError):
    """A write failed because the file system holding it is full (or over quota)."""


# How the C library words the two errnos. Tools run as subprocesses (the linker TVM calls
# to make a library) report them only in their output, so their text is matched as well.
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXTS = tuple(os.strerror(code) for code in _DISK_FULL_ERRNOS)


def disk_full_reason(error: BaseException) -> str | None:
    """One line saying why `error` is a full disk (an ENOSPC or EDQUOT anywhere in its chain
    of causes, or the C library's words for them in its message); None when it is not."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS:
            return e.strerror or os.strerror(e.errno)
        for line in str(e).splitlines():
            if any(text in line for text in _DISK_FULL_TEXTS):
                return line.strip()
        todo += [e.__cause__, e.__context__]
    return None
