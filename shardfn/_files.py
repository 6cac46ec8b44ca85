"""Files written whole or not at all: a temporary name, fsync of the file, rename, fsync of the folder.

A reader (a rank that loads a checkpoint, the launcher reading a rank's result) then sees either the
old state of the path or the complete new file, also after a crash of the machine: the file's data
is on disk before its name points to it, and the rename is on disk before the writer goes on.
"""

from __future__ import annotations

import os
import uuid

__all__ = ["write_atomically", "replace_synced", "fsync_file", "fsync_dir", "temporary_name"]


def fsync_file(path: str) -> None:
    """Flushes the file at `path` to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flushes the folder `path` (the names in it: creations and renames) to disk."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: str) -> str:
    """A hidden name next to `path`, unique to this write."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:8]}")


def replace_synced(tmp: str, path: str) -> None:
    """Gives the written temporary file `tmp` the name `path`: fsync, rename, fsync of the folder."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_atomically(path: str, data: bytes) -> None:
    """Writes `data` to `path` whole or not at all (the module docstring)."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        replace_synced(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
