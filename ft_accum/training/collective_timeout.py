"""A process that stops joining collective operations becomes a one-line error, not a hang.

Every process of a launch must make the same collective operations in the same order: gradient
all-reduces, FSDP's all-gathers in every forward, the barrier around a checkpoint. When one
process skips one (a model call on the main process only, issue 42), the others wait in it. The
process group's timeout (`--ddp_timeout`, passed to it through Accelerate's
`InitProcessGroupKwargs`) ends the wait: gloo raises a RuntimeError ("Timed out waiting 5000ms
for recv operation to complete") in each waiting process. `collective_failures` turns that into
one `error:` line that says after which update and in which phase (train, eval, save, sample) the
processes fell out of step, where the last complete checkpoint is, and the command to resume.
torchrun then stops the launch's other processes.

NCCL reports a timed-out collective from its watchdog thread and aborts the process itself
(TORCH_NCCL_ASYNC_ERROR_HANDLING, on by default): its own message, after the same timeout, not
this line. No GPU has run that path here.

`POSITION` is where this process's run is: the run's bookkeeping (training_state.RunTracker) keeps
it up to date, as the progress bars are known to `errors.register_progress_bar`.
"""

from __future__ import annotations

import contextlib
import datetime
import re
from dataclasses import dataclass
from typing import Optional

from ft_accum.core.errors import ConfigError

DEFAULT_TIMEOUT_SECONDS = 1800  # transformers' --ddp_timeout default: room for a checkpoint of GBs on a slow disk
# What gloo (and NCCL with blocking waits) say when a collective's partner never comes or has gone.
FAILURE_MARKERS = (
    "Timed out waiting",
    "timed out",
    "Connection closed by peer",
    "Connection reset by peer",
    "Watchdog caught collective operation timeout",
)


@dataclass
class RunPosition:
    """Where the run is: its phase, the updates it has completed, its last complete checkpoint."""

    phase: str = "setup"
    updates_done: int = 0
    last_checkpoint: Optional[str] = None
    resume_command: Optional[str] = None
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    process_index: int = 0
    num_processes: int = 1


POSITION = RunPosition()


def process_group_kwargs(timeout_seconds: float):
    """Accelerate's handler that gives the process group its collective timeout (and, after a torchrun
    restart, a rendezvous of its own attempt: training/elastic_restart.py)."""
    from accelerate.utils import InitProcessGroupKwargs

    from ft_accum.training import elastic_restart

    return InitProcessGroupKwargs(
        timeout=datetime.timedelta(seconds=timeout_seconds), init_method=elastic_restart.init_method()
    )


def start_run(timeout_seconds: float, process_index: int, num_processes: int) -> None:
    """A new run in this process (tests run several): back to the setup phase, nothing saved yet."""
    global POSITION
    POSITION = RunPosition(timeout_seconds=timeout_seconds, process_index=process_index, num_processes=num_processes)


@contextlib.contextmanager
def phase(name: str):
    """The run is in phase `name` (eval, save, sample) for the block, then back where it was. No
    `finally`: an error leaves the phase it was raised in, for its message."""
    before = POSITION.phase
    POSITION.phase = name
    yield
    POSITION.phase = before


def is_collective_failure(exc: BaseException) -> bool:
    """A collective operation that timed out, or whose partner process has gone."""
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in FAILURE_MARKERS)


def describe_failure(position: RunPosition, exc: BaseException) -> str:
    """The one line for a process that stopped joining collective operations: a partner that went away
    (gloo: "Connection closed by peer [host]:port", named by its host), or one that never came."""
    where = f"after update {position.updates_done}, in {position.phase}"
    saved = (
        f"the last complete checkpoint is {position.last_checkpoint}"
        if position.last_checkpoint
        else "no checkpoint was written before it"
    )
    resume = (
        f"; resume with: {position.resume_command}" if position.resume_command and position.last_checkpoint else ""
    )
    process = f"process {position.process_index} of {position.num_processes}"
    if "Connection" in str(exc):
        peer = re.search(r"by peer \[([^\]]+)\]", str(exc))
        # gloo names the peer's address when it has one; of 2 processes, the lost one is the other.
        lost = (
            f"the process on {peer.group(1)}"
            if peer
            else f"process {1 - position.process_index}"
            if position.num_processes == 2
            else "another process"
        )
        return (
            f"a process stopped joining collective operations ({where}): {process} lost its connection to {lost}, "
            f"which stopped (killed, crashed, or its machine went down: its own output says why); {saved}"
            f"{resume or '; rerun the launch on every machine with --resume_from_checkpoint auto'}"
        )
    return (
        f"a process stopped joining collective operations ({where}): {process} waited "
        f"{position.timeout_seconds:g} s (--ddp_timeout) for the others. Every process must make every model "
        f"call under FSDP or ZeRO-3 (docs/scale_out.md); {saved}{resume}"
    )


@contextlib.contextmanager
def collective_failures():
    """Around a recipe's run: a collective that timed out or lost its partner leaves as one ConfigError line."""
    try:
        yield
    except RuntimeError as exc:
        if not is_collective_failure(exc):
            raise
        raise ConfigError(describe_failure(POSITION, exc)) from None
