"""A graceful stop on SIGTERM (cluster preemption, `kill`) or SIGINT (Ctrl-C).

The first signal only sets a flag: the update in progress finishes, a checkpoint is written at
that sync step (so the resume is bit-identical, see checkpointing), the exact resume command is
printed, and the process exits with the shell's code for the signal, 128 + signum (143 for
SIGTERM, 130 for SIGINT). A second signal restores the default handler and re-sends itself, so
it stops the process at once.

SLURM and Ctrl-C signal the whole process group, so every process of a launch sees the flag; the
processes still agree at each update (one small all-reduce) so that all stop at the same one.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys

import torch

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class GracefulStop:
    """Install with `GracefulStop()`; ask `requested(accelerator)` once per update."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}
        for signum in SIGNALS:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread (e.g. a notebook runner): keep the defaults
                pass

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # the second signal: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal = signum
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
            f"stopped by {signal.Signals(signum).name}; saved {checkpoint}. Resume with:\n  {resume_command()}"
        )
        accelerator.end_training()
        self.restore()
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        """Put the previous handlers back (tests and notebooks run several recipes in one process)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


def resume_command(argv: list[str] | None = None, parent_argv: list[str] | None = None) -> str:
    """The command that started this run, with `--resume_from_checkpoint latest` in place of any earlier one.

    Under `accelerate launch` (and torchrun, which it runs in-process) the parent process holds the
    whole command line, launch options included; started with plain `python`, this process does.
    """
    argv = sys.argv if argv is None else argv
    if parent_argv is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent_argv = [a.decode() for a in f.read().split(b"\0") if a]
        except OSError:  # not Linux
            parent_argv = []
    launch = [i for i, a in enumerate(parent_argv) if a in ("launch", "accelerate.commands.launch")]
    if launch:
        command = ["accelerate", "launch", *parent_argv[launch[0] + 1 :]]
    else:
        command = ["python", *argv]
    kept, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg == "--resume_from_checkpoint":
            skip = True
        elif not arg.startswith("--resume_from_checkpoint="):
            kept.append(arg)
    return shlex.join([*kept, "--resume_from_checkpoint", "latest"])
