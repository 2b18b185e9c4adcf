"""A graceful stop on SIGTERM (cluster preemption, `kill`) or SIGINT (Ctrl-C).

The first signal only sets a flag: the update in progress finishes, a checkpoint is written at
that sync step (so the resume is bit-identical, see checkpointing), the exact resume command is
printed, and the process exits with the shell's code for the signal, 128 + signum (143 for
SIGTERM, 130 for SIGINT). A second signal restores the default handler and re-sends itself, so
it stops the process at once. A repeat of the same signal within `DUPLICATE_SECONDS` is not a
second signal but the launcher passing the first one on: under `kill -TERM -- -PGID` (SLURM,
Ctrl-C) torchrun's agent and `ft-accum launch` forward what the recipe has already received.

The command to resume with is read when the run starts (`GracefulStop.command`), while the
launcher that started it is certainly alive: `ft-accum launch` hands it over in
FT_ACCUM_LAUNCH_COMMAND; under `accelerate launch` it is the parent process's command line.

SLURM and Ctrl-C signal the whole process group, so every process of a launch sees the flag; the
processes still agree at each update (one small all-reduce) so that all stop at the same one.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time

import torch

from ft_accum.training.process_group_teardown import end_training

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_SECONDS = 1.0
LAUNCH_COMMAND_ENV = "FT_ACCUM_LAUNCH_COMMAND"  # set by ft-accum launch (ft_accum/cli/launcher.py)
# Environment settings that change what a launch runs, so a resume command must repeat them.
LAUNCH_ENV_SETTINGS = ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "CUDA_VISIBLE_DEVICES")


class GracefulStop:
    """Install with `GracefulStop()`; ask `requested(accelerator)` once per update."""

    def __init__(self):
        self.signal: int | None = None
        self.command = resume_command()
        self._first_at = 0.0
        self._previous = {}
        for signum in SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread (e.g. a notebook runner): keep the defaults
                pass

    def _handle(self, signum, frame) -> None:
        if signum == self.signal and time.monotonic() - self._first_at < DUPLICATE_SECONDS:
            return  # the launcher passing on the signal this process already has
        if self.signal is not None:  # the second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal, self._first_at = signum, time.monotonic()
        print(
            f"\n{signal.Signals(signum).name}: finishing the current update, then saving a checkpoint "
            "(send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def requested(self, accelerator) -> bool:
        """Whether any process has been signalled; every process gets the same answer."""
        if accelerator.num_processes == 1:
            return self.signal is not None
        flag = torch.tensor([self.signal or 0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item())

    def exit(self, accelerator, checkpoint) -> None:
        """Print the resume command and leave with 128 + the signal's number."""
        signum = self.signal or signal.SIGTERM
        accelerator.print(
            f"stopped by {signal.Signals(signum).name}; saved {checkpoint}. Resume with:\n  {self.command}"
        )
        end_training(accelerator)  # the group destroyed after train()'s locals, not by their release
        self.restore()
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        """Put the previous handlers back (tests and notebooks run several recipes in one process)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


def resume_command(
    argv: list[str] | None = None,
    parent_argv: list[str] | None = None,
    parent_environ: dict[str, str] | None = None,
    launch_command: str | None = None,
) -> str:
    """The command that started this run, with `--resume_from_checkpoint latest` in place of any earlier one.

    In order: the command `ft-accum launch` recorded (`launch_command`, FT_ACCUM_LAUNCH_COMMAND);
    under `accelerate launch` (and torchrun, which it runs in-process) the parent process's command
    line, launch options and --config_file included, after the parent's launch-changing
    environment settings (ACCELERATE_USE_CPU=true, ...); started with plain `python`, this
    process's own. Call it at the start of the run: at a stop, the launcher may be gone.
    """
    return _with_resume(started_command(argv, parent_argv, parent_environ, launch_command))


def started_command(
    argv: list[str] | None = None,
    parent_argv: list[str] | None = None,
    parent_environ: dict[str, str] | None = None,
    launch_command: str | None = None,
) -> list[str]:
    """The command that started this run, as words (see `resume_command`, which adds the resume flag)."""
    argv = sys.argv if argv is None else argv
    launch_command = os.environ.get(LAUNCH_COMMAND_ENV) if launch_command is None else launch_command
    if launch_command:
        return shlex.split(launch_command)
    if parent_argv is None:
        parent_argv = _read_proc(f"/proc/{os.getppid()}/cmdline")
        parent_environ = dict(kv.split("=", 1) for kv in _read_proc(f"/proc/{os.getppid()}/environ") if "=" in kv)
    launch = [i for i, a in enumerate(parent_argv) if a in ("launch", "accelerate.commands.launch")]
    if not launch:
        return ["python", *argv]
    environ = parent_environ or {}
    settings = [f"{name}={environ[name]}" for name in LAUNCH_ENV_SETTINGS if environ.get(name)]
    return [*settings, "accelerate", "launch", *parent_argv[launch[0] + 1 :]]


def _read_proc(path: str) -> list[str]:
    """A NUL-separated /proc file as strings; empty where there is none (not Linux, another user's)."""
    try:
        with open(path, "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _with_resume(command: list[str]) -> str:
    return shlex.join([*without_resume(command), "--resume_from_checkpoint", "latest"])


def without_resume(command: list[str]) -> list[str]:
    """`command` without its --resume_from_checkpoint flag: the command of a fresh start."""
    kept, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg == "--resume_from_checkpoint":
            skip = True
        elif not arg.startswith("--resume_from_checkpoint="):
            kept.append(arg)
    return kept
