"""One winner pick per problem and set of trials, among every worker on one Optuna storage.

The final interleaved re-measurement is noisy: two workers doing it over the same trials could
store two different winners. So it is claimed first. A claim is an Optuna study named

    autoflash-pick|<gpu key>|<problem key>|<digest of the candidates>|<generation>

Creating a study of a name that exists fails (a unique key on an RDB; the order of the log in a
journal), on every storage and across hosts: the worker that creates it does the pick, every
other one skips it. The claim's user attributes say who holds it ('owner', 'beat') and, once the
pick is stored, its outcome ('result': status, winner, milliseconds), which the others report.

A claim whose owner died before its result (a process of this host that is gone, or no heartbeat
for `storage.grace_s()`), or whose pick failed (the re-measure crashed or timed out), is taken
over by creating the next generation's study. A later run over *more* trials has a new digest,
so it picks again (and the stored winner competes as the incumbent); one over the same trials
finds the pick made and reports it.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time

import optuna

from autoflash.tuning.storage import grace_s, heartbeat_s, owner_alive, worker_id

MAX_GENERATIONS = 50
SETTLED = ("tuned", "no_valid_candidate")  # outcomes another pick over the same trials would repeat


def digest(candidate_keys) -> str:
    """The claim's key part for a set of candidates ('family:variant JSON')."""
    return hashlib.sha256("\n".join(sorted(candidate_keys)).encode()).hexdigest()[:16]


def claim_name(gpu_key: str, problem_key: str, candidates_digest: str, generation: int) -> str:
    return f"autoflash-pick|{gpu_key}|{problem_key}|{candidates_digest}|{generation}"


class Claim:
    """A pick this worker holds: beats while the pick runs, then records its result."""

    def __init__(self, storage, study_id: int, name: str):
        self.storage, self.study_id, self.name = storage, study_id, name
        self.owner = worker_id()
        storage.set_study_user_attr(study_id, "owner", self.owner)
        storage.set_study_user_attr(study_id, "beat", time.time())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_loop, name="autoflash-pick-beat", daemon=True)
        self._thread.start()

    def _beat_loop(self) -> None:
        while not self._stop.wait(heartbeat_s()):
            try:
                self.storage.set_study_user_attr(self.study_id, "beat", time.time())
            except Exception:  # noqa: BLE001 - a missed beat must never end the pick
                pass

    def finish(self, result) -> None:
        """Record the pick's outcome (a ProblemResult) for the workers that skipped it."""
        self._stop.set()
        self._thread.join(timeout=10)
        winner = result.winner
        record = {"status": result.status, "by": self.owner, "spread": _finite(result.spread),
                  "winner": None if winner is None else {"family": winner.family, "variant": winner.json()},
                  "ms": {k: _finite(v) for k, v in result.ms.items()}}
        self.storage.set_study_user_attr(self.study_id, "result", record)

    def abandon(self) -> None:
        """The pick raised: leave a failed result, so that another worker may take it over."""
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.storage.set_study_user_attr(self.study_id, "result", {"status": "abandoned", "by": self.owner})
        except Exception:  # noqa: BLE001
            pass


def claim_pick(storage, gpu_key: str, problem_key: str, candidates_digest: str) -> tuple[Claim | None, dict]:
    """(Claim, {}) when this worker is to pick; else (None, what the holder says: its 'result'
    when the pick is done, else {'status': 'picking', 'by': owner})."""
    grace = grace_s()
    for generation in range(MAX_GENERATIONS):
        name = claim_name(gpu_key, problem_key, candidates_digest, generation)
        try:
            study_id = storage.create_new_study([optuna.study.StudyDirection.MINIMIZE], name)
        except optuna.exceptions.DuplicatedStudyError:
            study_id = storage.get_study_id_from_name(name)
        else:
            return Claim(storage, study_id, name), {}
        attrs = storage.get_study_user_attrs(study_id)
        result = attrs.get("result")
        if result is not None:
            if result.get("status") in SETTLED:
                return None, result
            continue  # failed or abandoned: the next generation tries again
        owner = attrs.get("owner")
        if owner is None:  # created this instant, or its creator died before saying who it is
            seen = attrs.get("ownerless_since")
            if seen is None:
                storage.set_study_user_attr(study_id, "ownerless_since", time.time())
                return None, {"status": "picking", "by": "?"}
            if time.time() - float(seen) <= grace:
                return None, {"status": "picking", "by": "?"}
            continue
        if owner_alive(owner, float(attrs.get("beat", 0.0)), grace):
            return None, {"status": "picking", "by": owner}
        # its owner died mid-pick: take it over with the next generation
    raise RuntimeError(f"{MAX_GENERATIONS} failed picks of {problem_key}: giving up")


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
