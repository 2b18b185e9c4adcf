"""`ft-accum launch`: `accelerate launch`, with a stop that waits for the checkpoint.

`ft-accum launch [accelerate launch options] recipes/<name>.py [recipe flags]` parses its options
with Accelerate's own parser and runs Accelerate's own `launch_command`; it adds three things that
Accelerate 1.15's launcher lacks (docs/reliability.md has the measurements):

- **It waits.** A one-process `accelerate launch` starts the recipe with `subprocess.Popen` and
  installs no signal handler: SIGTERM or SIGINT ends the launcher at once, while the recipe is
  still finishing its update and writing its checkpoint. Here the launcher catches the signal,
  passes it on to the recipe (a container's PID 1 or a scheduler may signal the launcher alone)
  and returns only when the recipe has exited. Several processes go through torchrun, whose agent
  already forwards the signal and waits; here its grace period is raised from 30 s to
  `GRACE_SECONDS` unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT is set.
- **It exits as the recipe did**: 143 after a SIGTERM stop, 130 after Ctrl-C, the recipe's own
  code after an error, without the traceback Accelerate prints for any non-zero exit.
- **One error line for several processes.** Each process that refuses its input writes its `error:`
  line to a folder (errors.ERROR_DIR_ENV) instead of stderr, and torchrun's own failure report is
  silenced: the launcher prints each distinct line once, or, for a process that died without one
  (a crash, a signal; its traceback is above), one line naming it and its exit code. Plain
  `accelerate launch` prints the line once per process, then torchrun's report.
- **It records the command.** The exact command line, with the environment settings that change
  what it runs (ACCELERATE_USE_CPU, ...), is handed to the recipe (`LAUNCH_COMMAND_ENV`), which
  writes it to its output folder at the start and prints it as the resume command at a stop.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from ft_accum.core.errors import ERROR_DIR_ENV
from ft_accum.training.graceful_stop import LAUNCH_COMMAND_ENV, LAUNCH_ENV_SETTINGS

GRACE_SECONDS = 600


def command_line(argv: list[str], environ: dict[str, str] | os._Environ = os.environ) -> str:
    """`ft-accum launch ...` as typed, prefixed with the launch-changing environment settings that are set."""
    settings = [f"{name}={shlex.quote(environ[name])}" for name in LAUNCH_ENV_SETTINGS if environ.get(name)]
    return " ".join([*settings, shlex.join(["ft-accum", "launch", *argv])])


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Forwarder:
    """The signal handler of the one-process launch: remember the signal and pass it to the recipe.

    Under `kill -TERM -- -PGID` (SLURM, Ctrl-C) the recipe gets the signal twice, from the kernel
    and from here, a few milliseconds apart; graceful_stop.GracefulStop counts the pair as one.
    """

    def __init__(self):
        self.signal: int | None = None

    def __call__(self, signum, frame) -> None:
        self.signal = signum
        import psutil  # a dependency of accelerate

        for child in psutil.Process().children():
            try:
                child.send_signal(signum)
            except psutil.NoSuchProcess:
                pass


def launch(argv: list[str]) -> int:
    """Run `accelerate launch argv`; return the exit code for the shell (see the module docstring)."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    os.environ[LAUNCH_COMMAND_ENV] = command_line(argv)
    remove_stale_error_dirs()
    error_dir = os.environ[ERROR_DIR_ENV] = tempfile.mkdtemp(prefix=f"{ERROR_DIR_PREFIX}{os.getpid()}-")
    quiet_torchrun_reports()
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(GRACE_SECONDS))
    forwarder = _Forwarder()
    # torchrun's agent replaces these with its own (which forward and wait) when it starts.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forwarder)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as exc:  # the one-process launcher, after the recipe exited non-zero
        return exit_code(exc.returncode)
    except SignalException as exc:  # torchrun's agent, after its workers exited or its grace period ended
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:  # a worker failed on its own
        rank, failure = exc.get_first_failure()
        print_errors_once(error_dir, rank, exit_code(failure.exitcode))
        return exit_code(failure.exitcode)
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)
    return 128 + forwarder.signal if forwarder.signal else 0


ERROR_DIR_PREFIX = "ft-accum-errors-"


def remove_stale_error_dirs(temp_dir: str | None = None) -> None:
    """Remove the error folders of launchers that are gone: one killed with SIGKILL (or the machine's
    OOM killer) cannot remove its own. Each folder's name holds its launcher's process id."""
    import psutil  # a dependency of accelerate

    for folder in Path(temp_dir or tempfile.gettempdir()).glob(f"{ERROR_DIR_PREFIX}*-*"):
        pid = folder.name.removeprefix(ERROR_DIR_PREFIX).split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def quiet_torchrun_reports() -> None:
    """torchrun's agent logs each failed worker and the signals it sends the others (W/E lines after the
    worker's own error); under this launcher `print_errors_once` reports instead."""
    import logging

    import torch.distributed.run  # noqa: F401  (creates the agent's loggers, each with its own level)

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def print_errors_once(error_dir: str, rank: int, code: int) -> None:
    """Each distinct `error:` line the processes left in `error_dir`, once; or, where none did (a crash
    or a signal), one line naming the first failed process."""
    messages = sorted({p.read_text() for p in Path(error_dir).glob("rank-*")})
    for message in messages or [f"error: process {rank} exited with code {code}; its output above says why"]:
        print(message, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    return launch(sys.argv[1:] if argv is None else argv)
