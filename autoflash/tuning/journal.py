"""Optuna's journal beside the results DB, with a lock that survives `kill -9`.

Optuna's default journal lock (a symlink `<journal>.lock`) left by a process killed inside its
critical section stalls every later run for its 30 s grace period. `JournalPidLock` writes the
owner's host and pid into the lock file, so a dead owner's lock is cleared at once; the journal
is opened only after a stale lock is cleared.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time

import optuna

try:
    from optuna.storages.journal._file import BaseJournalFileLock
except ImportError:  # a future Optuna that moved it: its public lock classes share the interface
    BaseJournalFileLock = object


JOURNAL_LOCK_GRACE_S = 30.0  # an owner we cannot check (another host, Optuna's symlink lock): its age

# Lock files this process holds, and the thread holding each. A lock file naming this process
# that is not here, or that the asking thread itself "holds", was left by an interrupt (Ctrl-C
# between the file's creation and Optuna's try/finally): stale, not a live writer's.
_HELD: dict[str, int] = {}


class JournalPidLock(BaseJournalFileLock):
    """Optuna's journal-file lock as an exclusive file `<journal>.lock` holding 'host pid'. A lock
    left by a killed process (`kill -9` inside Optuna's critical section) is cleared as soon as its
    pid is seen dead on this host, one left by an interrupt in this process at its next acquire,
    not after a stall; one whose owner cannot be checked (another host, Optuna's own symlink lock)
    after JOURNAL_LOCK_GRACE_S without change."""

    def __init__(self, filepath: str, grace_s: float = JOURNAL_LOCK_GRACE_S):
        self.lock_file = filepath + ".lock"  # the same name as Optuna's locks: they exclude each other
        self.grace_s = grace_s

    def acquire(self) -> bool:
        # The lock appears with its owner already written (a filled temporary file hard-linked into
        # place, which fails if the lock exists): no reader ever sees an empty, uncheckable lock.
        text = f"{socket.gethostname()} {os.getpid()}\n"
        owner = f"{self.lock_file}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(owner, "w") as f:
                f.write(text)
            delay = 0.001
            while True:
                try:
                    _create_exclusively(self.lock_file, owner, text)
                except FileExistsError:
                    if not clear_stale_journal_lock(self.lock_file, self.grace_s):
                        time.sleep(delay)
                        delay = min(delay * 2, 0.05)
                    continue
                _HELD[self.lock_file] = threading.get_ident()
                return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(owner)

    def release(self) -> None:
        _HELD.pop(self.lock_file, None)
        try:
            os.unlink(self.lock_file)
        except OSError as e:
            raise RuntimeError(f"error releasing the journal lock {self.lock_file}: {e}") from e


def _create_exclusively(path: str, filled: str, text: str) -> None:
    """Create `path` holding `text`, or raise FileExistsError: a hard link of the filled file
    `filled`; where the file system has no hard links, an O_EXCL create and a write."""
    try:
        os.link(filled, path)
        return
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def clear_stale_journal_lock(lock_file: str, grace_s: float = JOURNAL_LOCK_GRACE_S) -> bool:
    """Remove `lock_file` when its owner is gone: a 'host pid' lock of this host whose process is
    dead, one of this process that no live thread of it holds (see _HELD), or any lock (Optuna's
    symlink, an unreadable one) unchanged for grace_s seconds. True when no lock is left (removed,
    or none was there)."""
    try:
        st = os.lstat(lock_file)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    stale = time.time() - st.st_mtime > grace_s
    if not stale and not os.path.islink(lock_file):
        try:
            with open(lock_file, encoding="utf-8") as f:
                host, pid = f.read().split()
            if host == socket.gethostname() and int(pid) != os.getpid():
                os.kill(int(pid), 0)
            elif host == socket.gethostname():
                holder = _HELD.get(lock_file)
                stale = holder is None or holder == threading.get_ident() or holder not in {
                    t.ident for t in threading.enumerate()}
        except ProcessLookupError:
            stale = True  # its process died holding it
        except (OSError, ValueError):  # unreadable, half-written, alive under another user
            pass
    if not stale:
        return False
    try:
        again = os.lstat(lock_file)
        if (again.st_ino, again.st_mtime_ns) == (st.st_ino, st.st_mtime_ns):  # still the lock judged stale
            os.unlink(lock_file)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def journal_backend(db_path) -> "optuna.storages.journal.JournalFileBackend":
    """Optuna's journal beside the DB, with a stale lock (a killed run's) cleared before opening."""
    return journal_file_backend(f"{db_path}.optuna.journal")  # (tuner.optuna_storage_path)


def journal_file_backend(path) -> "optuna.storages.journal.JournalFileBackend":
    """An Optuna journal file anywhere (`autoflash tune --storage FILE`, e.g. on a shared file
    system), with a stale lock cleared before opening."""
    path = str(path)
    lock = JournalPidLock(path)
    clear_stale_journal_lock(lock.lock_file, lock.grace_s)
    return optuna.storages.journal.JournalFileBackend(path, lock_obj=lock)
