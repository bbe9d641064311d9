"""The lock that gives an output directory to one run at a time: OUTPUT/.bigfit-lock.

An exclusive `flock` on the lock file, not the file's existence, is the lock: the kernel (or the
NFS lock manager) releases it when the holder dies however it dies, so a SIGKILLed run never
leaves a lock that blocks the next one, and pid reuse cannot fool it. The file holds the holder's
host, pid and start time, for the message a second run gets, and for the note that a stale file
(left by a holder that ended without removing it) was taken over. Launchers pass the descriptor to
their workers, so the directory stays locked while any process of the job lives.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import BigfitError

NAME = ".bigfit-lock"
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # file systems without locks


def holder_text(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {started}"


class RunLock:
    """`acquire` takes the lock of `directory` (creating it) or raises a BigfitError naming the
    holder; `release` gives it back and removes the file. `notes` says what the user should know."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / NAME
        self.fd: int | None = None
        self.notes: list[str] = []

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while self.fd is None:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in UNSUPPORTED:
                    self.notes.append(f"warning: {self.path.parent} is on a file system without file locks: "
                                      "a second run into it would not be stopped")
                    return self
                raise BigfitError(f"--output-dir {str(self.path.parent)!r} is in use by another bigfit run "
                                  f"({holder_text(self._read())}); wait for it to end, or choose another "
                                  "--output-dir") from None
            if self._same_file(fd):
                self.fd = fd
            else:  # the holder removed the file between our open and our lock: lock the new one
                os.close(fd)
        if (old := self._read()) and old.get("pid"):
            self.notes.append(f"note: {self.path} was left by {holder_text(old)}, which ended without removing "
                              "it; taken over")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "argv": sys.argv}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(info).encode(), 0)
        return self

    def _open(self) -> int:
        """The lock file, never through a link: one there would have bigfit write into what it points to."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise BigfitError(f"--output-dir {str(self.path.parent)!r}: {NAME} is a symbolic link (to "
                              f"{os.readlink(self.path)!r}), where bigfit keeps its lock file; remove the link") from None

    def _same_file(self, fd: int) -> bool:
        try:
            return os.lstat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _read(self) -> dict:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking: a waiter that locks this inode sees it gone
        os.close(self.fd)
        self.fd = None
