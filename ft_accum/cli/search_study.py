"""The study shared by several sweeps (`--worker`): its storage, the lock under which new trials are asked
for, and the trials left RUNNING by a sweep that died, taken up by another.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from ft_accum.cli.search_space import sample
from ft_accum.core.errors import ConfigError

JOURNAL_FILE = "study.journal"
HEARTBEAT_SECONDS = 60


STALE_SECONDS = 600  # a trial whose sweep, on another machine, has not written a heartbeat for this long is taken up


def open_storage(optuna, search: dict, output_dir: Path, worker: bool):
    """The journal file in the output folder by default, else the RDB URL; refused where it cannot be opened,
    and under --worker where it cannot be shared."""
    url = search["storage"]
    if url is None or str(url).startswith("journal:"):
        path = Path(str(url).removeprefix("journal:")) if url else output_dir / JOURNAL_FILE
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            backend = JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path)))
        except OSError as exc:
            raise ConfigError(f"cannot open the study's journal file {path}: {exc.strerror}; check the path") from None
        return optuna.storages.JournalStorage(backend), f"journal:{path}"
    url = str(url)
    if worker and (url.startswith("sqlite") or ":memory:" in url):
        raise ConfigError(
            f"--worker needs a storage several sweeps can write at once; {url} is a SQLite file, whose locks Optuna "
            "advises against for parallel workers (and which fail on network filesystems). Leave storage out (a "
            "journal file in the output folder, on a filesystem every worker sees) or give postgresql:// or mysql://"
        )
    try:
        return optuna.storages.RDBStorage(url, skip_compatibility_check=False), url
    except Exception as exc:  # SQLAlchemy's errors: a bad URL, a missing driver, a server that does not answer
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"cannot open the study storage {url}: {reason}; check the URL (e.g. sqlite:///study.db, "
            "postgresql://user:password@host/db) and that its driver is installed, or leave storage out for a journal file"
        ) from None


class AskLock:
    """The output folder's lock file (Optuna's NFS-safe O_EXCL lock): one sweep at a time counts the
    trials, takes up an abandoned one or asks for a new one, so the study never passes n_trials."""

    def __init__(self, output_dir: Path):
        from optuna.storages.journal import JournalFileOpenLock

        self.lock = JournalFileOpenLock(str(output_dir / ".trials"), grace_period=30)

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


def this_process() -> str:
    """`host:pid:start-time`: a process id that a later process with the same pid does not match."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def owner_is_gone(owner: str | None, heartbeat: float | None, now: float) -> bool:
    """Whether the sweep that ran a RUNNING trial has died: on this machine, its process is gone; on
    another, it has not written a heartbeat for STALE_SECONDS."""
    if not owner:
        return True
    host, pid, started = owner.rsplit(":", 2)
    if host == socket.gethostname():
        return _start_time(int(pid)) != started
    return heartbeat is None or now - heartbeat > STALE_SECONDS


def claim_trial(optuna, study, search: dict):
    """(trial, taken_up) for this sweep to run, or None when the study has n_trials and none is abandoned."""
    trials = study.get_trials(deepcopy=False)
    now = time.time()
    for frozen in trials:
        attrs = frozen.user_attrs
        if frozen.state == optuna.trial.TrialState.RUNNING and owner_is_gone(
            attrs.get("owner"), attrs.get("heartbeat"), now
        ):
            trial = optuna.trial.Trial(study, frozen._trial_id)
            trial.set_user_attr("owner", this_process())
            trial.set_user_attr("heartbeat", now)
            return trial, True
    waiting = any(t.state == optuna.trial.TrialState.WAITING for t in trials)  # enqueued: ask() pops these first
    if len(trials) >= search["n_trials"] and not waiting:
        return None
    trial = study.ask()
    trial.set_user_attr("owner", this_process())
    trial.set_user_attr("heartbeat", now)
    sample(trial, search["space"])  # under the lock: the next ask sees these parameters
    return trial, False
