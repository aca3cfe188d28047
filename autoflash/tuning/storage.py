"""Where the Optuna studies live (`autoflash tune --storage`), and how a dead worker's trial is
found and tried again.

  (none)              the journal file beside the results DB, `<db>.optuna.journal` (one host)
  FILE                an Optuna journal file anywhere, e.g. on a file system that several hosts
                      mount (its lock is an O_EXCL file: `journal.JournalPidLock`)
  postgresql://...    an Optuna RDBStorage (any SQLAlchemy URL: mysql://..., sqlite:///...), with
                      Optuna's heartbeat: a trial whose worker stopped beating is failed; an
                      sqlite:/// file must be new, empty or Optuna's (never the results DB)

Every worker that measures a trial marks it with its owner ('host pid') and keeps it beating
(`Liveness`): on an RDB through Optuna's heartbeat table, on a journal through a user attribute.
A RUNNING trial is dead when its owner is a process of this host that is gone (seen at once), or
when it has not beaten for `grace_s` (another host's). `Liveness.reap` fails such trials and
queues each one again (WAITING, same parameters), so the next `ask` of any worker measures it:
a worker that dies loses only the trial it was running, and only for a while.

What is *not* here: the results. Trials and winners stay in each host's SQLite file (WAL),
written as they happen; the studies only coordinate the search (see `autoflash.tuning.workers`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import re
import socket
import threading
import time
import warnings

import optuna
from optuna.trial import TrialState

log = logging.getLogger("autoflash.tuning")

OWNER_ATTR = "worker"  # 'host pid' of the worker measuring a trial
BEAT_ATTR = "beat"  # journal storages: time.time() of the trial's last heartbeat
STATUS_ATTR = "status"  # the outcome of a trial some worker measured (ok, wrong, timeout, ...)
MEASURING_ATTR = "measuring"  # set when a worker starts measuring a trial (not only asked for it)
MAX_RETRIES = 3  # a trial whose workers keep dying is given up after this many retries


class StorageError(ValueError):
    """The --storage URL cannot be used (unreachable server, no driver, bad path)."""


# libpq waits for a server that never answers for as long as TCP does (minutes, or forever
# behind a firewall that drops packets): a tune must say that it cannot connect, and soon.
CONNECT_TIMEOUT_S = 10
# Tables of an Optuna RDB storage: an SQLite file without them (a results DB, another program's
# DB) would be given Optuna's tables beside its own, and one it already has (`trials`) breaks them.
_OPTUNA_TABLES = {"studies", "version_info"}


def heartbeat_s() -> int:
    """Seconds between heartbeats ($AUTOFLASH_HEARTBEAT_S, default 10; Optuna wants an integer)."""
    try:
        return max(1, int(os.environ.get("AUTOFLASH_HEARTBEAT_S", "10")))
    except ValueError:
        return 10


def grace_s() -> float:
    """How long a trial (or a winner pick) of another host may go without a heartbeat."""
    return 3.0 * heartbeat_s()


def worker_id() -> str:
    return f"{socket.gethostname()} {os.getpid()}"


def is_url(storage: str | None) -> bool:
    return bool(storage) and "://" in str(storage)


def describe(storage: str | None, db_path=None) -> str:
    """For messages: the journal's path, or the URL without its password."""
    if not storage:
        return f"journal {db_path}.optuna.journal"
    if not is_url(storage):
        return f"journal {storage}"
    try:
        from sqlalchemy.engine import make_url

        return make_url(storage).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a malformed URL: hide what stands where a password would
        return re.sub(r"^([^:/]+://[^:@/]*:)[^@]*@", r"\1***@", storage)


def connect_timeout_s() -> int:
    """Seconds to wait for a database server to answer ($AUTOFLASH_CONNECT_TIMEOUT_S, default 10)."""
    try:
        return max(1, int(os.environ.get("AUTOFLASH_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S)))
    except ValueError:
        return CONNECT_TIMEOUT_S


def make_storage(storage: str | None, db_path) -> optuna.storages.BaseStorage:
    """The Optuna storage of `--storage` (None: the journal beside the results DB at db_path)."""
    from autoflash.tuning.journal import journal_backend, journal_file_backend

    if not storage:
        return optuna.storages.JournalStorage(journal_backend(db_path))
    if not is_url(storage):
        if reason := _not_a_journal(storage):
            raise StorageError(f"cannot use {storage} as an Optuna journal: {reason} (name a new file, or one "
                               "that an earlier `autoflash tune --storage` wrote)")
        try:
            return optuna.storages.JournalStorage(journal_file_backend(os.path.abspath(storage)))
        except OSError as e:
            raise StorageError(f"cannot use the journal file {storage}: {e.strerror or e}") from None
    return _rdb_storage(storage, db_path)


def _not_a_journal(path: str) -> str | None:
    """Why an existing file is no Optuna journal (whose lines are JSON objects), or None. Optuna
    appends its records to whatever file it is given: a results DB or another text file would be
    written into before the first read failed."""
    try:
        with open(path, "rb") as f:
            first = f.readline()
    except FileNotFoundError:
        return None
    except OSError:
        return None  # (the journal backend says what is wrong with it)
    if not first.strip():
        return None
    if first.startswith(b"SQLite format 3"):
        return "it is an SQLite database"
    try:
        record = json.loads(first)
    except ValueError:
        return "its first line is not a journal record"
    # (a JSON-lines log's lines are JSON objects too: a journal's carry Optuna's operation code)
    if not isinstance(record, dict) or not {"op_code", "worker_id"} <= record.keys():
        return "its first line is not a journal record"
    return None


def _sqlite_file(url) -> str | None:
    """The file an sqlite:// URL names (None: in memory, or another database)."""
    if not url.drivername.startswith("sqlite") or url.database in (None, "", ":memory:"):
        return None
    path = url.database
    if path.startswith("file:"):  # (SQLite's URI form, sqlite:///file:x.db?uri=true)
        path = path[len("file:"):]
    return os.path.abspath(path)


def _not_an_optuna_db(path: str, db_path) -> str | None:
    """Why an SQLite file cannot hold Optuna's tables, or None (missing, empty, or Optuna's)."""
    import sqlite3
    import urllib.parse

    from autoflash.store_validate import _same_file

    if db_path is not None and _same_file(pathlib.Path(path), pathlib.Path(db_path)):
        return "it is the results DB (or one of its files): the studies need a file of their own"
    try:
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            return None
        with open(path, "rb") as f:
            if f.read(16) != b"SQLite format 3\x00":
                return "it is no SQLite database"
        uri = "file:" + urllib.parse.quote(path) + "?mode=ro"
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=30)) as conn:
            tables = {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}
    except (OSError, sqlite3.Error) as e:
        return f"it cannot be read ({e})"
    if tables and not _OPTUNA_TABLES <= tables:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        return f"it is another program's SQLite database (tables {shown}), not an Optuna storage"
    return None


def _rdb_storage(given: str, db_path=None) -> optuna.storages.RDBStorage:
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(given)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy says ValueError or ArgumentError: one line
        reason = str(e).strip() or type(e).__name__
        if port := re.search(r"invalid literal for int\(\) with base 10: (.*)", reason):
            reason = f"its port {port.group(1)} is not a number"
        raise StorageError(f"malformed storage URL {describe(given)}: {reason}") from None
    sqlite_file = _sqlite_file(parsed)
    if sqlite_file and (reason := _not_an_optuna_db(sqlite_file, db_path)):
        raise StorageError(f"cannot use {describe(given)} as the Optuna storage: {reason} (name a new file)")
    engine_kwargs = {"pool_pre_ping": True}
    if parsed.drivername.startswith("postgres") and "connect_timeout" not in parsed.query:
        engine_kwargs["connect_args"] = {"connect_timeout": connect_timeout_s()}
    url = _with_driver(given)
    interval = heartbeat_s()
    for attempt in range(5):  # workers starting together race to create the tables: try again
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url, heartbeat_interval=interval, grace_period=int(grace_s()),
                    heartbeat_stale_trial_callback=retry_trial, engine_kwargs=engine_kwargs)
        except ImportError as e:
            cause = e.__cause__ or e
            hint = ("pip install 'autoflash[postgres]'" if given.startswith("postgres")
                    else "the SQLAlchemy driver of that database")
            raise StorageError(f"no database driver for {describe(given)} ({cause}): install it, e.g. {hint}") from None
        except Exception as e:  # noqa: BLE001 - SQLAlchemy's errors: one line for the user
            text = str(e).lower()
            if attempt == 4 or any(w in text for w in ("connect", "argument", "timeout", "timed out")):
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise StorageError(f"cannot open the Optuna storage {describe(given)}: {first}") from None
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _with_driver(url: str) -> str:
    """A bare postgresql:// (or postgres://) / mysql:// URL with the driver that is installed
    (psycopg 3, else psycopg2; mysqlclient, else PyMySQL)."""
    import importlib.util

    scheme, sep, rest = url.partition("://")
    if scheme in ("postgres", "postgresql"):  # (SQLAlchemy's own default differs between its versions)
        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return f"postgresql+psycopg2://{rest}"
        return f"postgresql+psycopg://{rest}"
    if scheme == "mysql" and importlib.util.find_spec("MySQLdb") is None and importlib.util.find_spec("pymysql"):
        return f"mysql+pymysql://{rest}"
    return url


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def owner_alive(owner: str | None, last_beat: float, grace: float) -> bool:
    """Whether the worker 'host pid' (None: unknown) still runs: by its pid on this host, else by
    its last heartbeat (time.time()) being younger than `grace`."""
    if owner:
        host, _, pid = owner.rpartition(" ")
        if host == socket.gethostname() and pid.isdigit():
            return pid_alive(int(pid))
    return time.time() - last_beat <= grace


def retry_trial(study, trial) -> None:
    """Queue a dead worker's trial again: WAITING, its parameters, without its owner's marks.
    (The storage's heartbeat callback on an RDB; `Liveness.reap` on a journal.)"""
    history = list(trial.system_attrs.get("retry_history", [])) + [trial.number]
    if not trial.params or len(history) > MAX_RETRIES:
        return
    user_attrs = {k: v for k, v in trial.user_attrs.items()
                  if k not in (OWNER_ATTR, BEAT_ATTR, STATUS_ATTR, MEASURING_ATTR)}
    # 'owed': its worker died measuring it (not only holding it, asked for, in its next batch):
    # it is measured again whatever the budget says.
    system_attrs = {**trial.system_attrs, "failed_trial": history[0], "retry_history": history,
                    "owed": bool(trial.user_attrs.get(MEASURING_ATTR) or trial.system_attrs.get("owed"))}
    study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING, params=trial.params,
                                              distributions=trial.distributions, user_attrs=user_attrs,
                                              system_attrs=system_attrs))
    log.info("trial %d of %s: its worker died; queued again", trial.number, study.study_name)


class Liveness:
    """This worker's RUNNING trials: their owner mark and heartbeat (a daemon thread), and the
    failing of other workers' dead trials."""

    def __init__(self, storage: optuna.storages.BaseStorage):
        self.storage = storage
        self.rdb = isinstance(storage, optuna.storages.RDBStorage)
        self.owner = worker_id()
        self.interval = heartbeat_s()
        self.grace = grace_s()
        self._running: set[int] = set()
        self._searching: dict[int, int] = {}  # study id -> searches of it under way in this worker
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_loop, name="autoflash-heartbeat", daemon=True)
        self._thread.start()

    def adopt(self, trial_id: int) -> None:
        """Mark a trial this worker asked for as its own, and keep it beating until it is told."""
        self.storage.set_trial_user_attr(trial_id, OWNER_ATTR, self.owner)
        self._beat(trial_id)
        with self._lock:
            self._running.add(trial_id)

    def searching(self, study_id: int, on: bool) -> None:
        """Say in the study (user attribute 'searching:<owner>') that this worker searches it: a
        worker about to pick the problem's winner waits for the searches of the others."""
        with self._lock:
            n = self._searching.get(study_id, 0) + (1 if on else -1)
            self._searching[study_id] = max(0, n)
        self.storage.set_study_user_attr(study_id, f"searching:{self.owner}", time.time() if n > 0 else None)

    def searchers(self, study_id: int) -> int:
        """How many other live workers search the study now."""
        attrs = self.storage.get_study_user_attrs(study_id)
        return sum(1 for key, beat in attrs.items() if key.startswith("searching:") and beat is not None
                   and key[len("searching:"):] != self.owner and owner_alive(key[len("searching:"):], beat, self.grace))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _beat(self, trial_id: int) -> None:
        if self.rdb:
            self.storage.record_heartbeat(trial_id)
        else:
            self.storage.set_trial_user_attr(trial_id, BEAT_ATTR, time.time())

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                trial_ids = list(self._running)
                studies = [study_id for study_id, n in self._searching.items() if n > 0]
            for study_id in studies:
                try:
                    self.storage.set_study_user_attr(study_id, f"searching:{self.owner}", time.time())
                except Exception as e:  # noqa: BLE001
                    log.warning("heartbeat of study %d failed: %s", study_id, e)
            for trial_id in trial_ids:
                try:
                    if self.storage.get_trial(trial_id).state.is_finished():
                        with self._lock:
                            self._running.discard(trial_id)
                        continue
                    self._beat(trial_id)
                except Exception as e:  # noqa: BLE001 - a missed beat must never end the run
                    log.warning("heartbeat of trial %d failed: %s", trial_id, e)

    def reap(self, study) -> int:
        """Fail the RUNNING trials of `study` whose worker is dead and queue each again; how many."""
        with self._lock:
            mine = set(self._running)
        failed = 0
        for trial_id in self._dead_trials(study):
            trial = self.storage.get_trial(trial_id)
            if trial_id in mine or trial.state != TrialState.RUNNING:
                continue
            # Queued again before it is failed: at no moment is its place in the budget free for
            # another candidate. (Two workers reaping it at once queue it twice: one is measured.)
            retry_trial(study, trial)
            try:
                self.storage.set_trial_state_values(trial_id, state=TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # another worker failed it first (or its owner told it after all)
            failed += 1
        return failed

    def _dead_trials(self, study) -> list[int]:
        if self.rdb:
            try:
                return list(self.storage._get_stale_trial_ids(study._study_id))
            except AttributeError:  # an Optuna without it: rely on the owner marks below
                pass
        dead = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            owner = t.user_attrs.get(OWNER_ATTR)
            if owner == self.owner:
                continue
            started = t.datetime_start.timestamp() if t.datetime_start else 0.0
            if not owner_alive(owner, max(float(t.user_attrs.get(BEAT_ATTR, 0.0)), started), self.grace):
                dead.append(t._trial_id)
        return dead
