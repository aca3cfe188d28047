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

# Lock files this process holds (by real path), and the thread holding each. A lock file naming
# this process that is not here, or that the asking thread itself "holds", was left by an
# interrupt (Ctrl-C between the file's creation and Optuna's try/finally): stale, not a live
# writer's. _HELD_LOCK makes "create + record", "forget + remove" and "judge + remove" of this
# process's locks one step each, so threads of one process never take a held lock from each other.
_HELD: dict[str, int] = {}
_HELD_LOCK = threading.Lock()


class JournalPidLock(BaseJournalFileLock):
    """Optuna's journal-file lock as an exclusive file `<journal>.lock` holding 'host pid'. A lock
    left by a killed process (`kill -9` inside Optuna's critical section) is cleared as soon as its
    pid is seen dead on this host, one left by an interrupt in this process at its next acquire,
    not after a stall; one whose owner cannot be checked (another host, Optuna's own symlink lock)
    after JOURNAL_LOCK_GRACE_S without change. (Two containers sharing a hostname, a file system
    and pid numbers would take each other's locks for dead or their own: give them distinct hostnames.)"""

    def __init__(self, filepath: str, grace_s: float = JOURNAL_LOCK_GRACE_S):
        self.lock_file = filepath + ".lock"  # the same name as Optuna's locks: they exclude each other
        self.grace_s = grace_s

    def acquire(self) -> bool:
        delay = 0.001
        while True:
            with _HELD_LOCK:
                created = _create_lock(self.lock_file)
                if created:
                    _HELD[os.path.realpath(self.lock_file)] = threading.get_ident()
                    return True
            if not clear_stale_journal_lock(self.lock_file, self.grace_s):
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def release(self) -> None:
        with _HELD_LOCK:
            key = os.path.realpath(self.lock_file)
            if _HELD.get(key) == threading.get_ident():
                del _HELD[key]
            try:
                os.unlink(self.lock_file)
            except OSError as e:
                raise RuntimeError(f"error releasing the journal lock {self.lock_file}: {e}") from e


def _create_lock(path: str) -> bool:
    """Create the lock file `path` holding 'host pid', or return False if it exists. The lock
    appears with its owner already written: a filled file, made fresh for this attempt (so the lock
    is as new as the attempt), is hard-linked into place, which fails if the lock exists; where the
    file system has no hard links, an O_EXCL create and a write."""
    text = f"{socket.gethostname()} {os.getpid()}\n"
    owner = f"{path}.{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    try:
        with open(owner, "w") as f:
            f.write(text)
        try:
            os.link(owner, path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(owner)


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
            if host == socket.gethostname() and int(pid) == os.getpid():
                with _HELD_LOCK:  # judged and removed in one step (see _HELD_LOCK)
                    holder = _HELD.get(os.path.realpath(lock_file))
                    if holder is not None and holder != threading.get_ident() and holder in {
                            t.ident for t in threading.enumerate()}:
                        return False  # a live thread of this process holds it
                    return _remove_if_unchanged(lock_file, st)
            if host == socket.gethostname():
                os.kill(int(pid), 0)
        except ProcessLookupError:
            stale = True  # its process died holding it
        except (OSError, ValueError):  # unreadable, half-written, alive under another user
            pass
    return _remove_if_unchanged(lock_file, st) if stale else False


def _remove_if_unchanged(lock_file: str, st: os.stat_result) -> bool:
    """Remove the lock judged stale from `st`, unless it was replaced meanwhile; True when no lock is left."""
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
