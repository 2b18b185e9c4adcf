"""Launching one recipe run and watching it: what `ft-accum sweep`'s grid and its Optuna search share.

Each run goes through `ft-accum launch` (Accelerate's own launch, which also waits for the
recipe's checkpoint at a stop signal), in a session of its own, with its output appended to
`<run_dir>/log.txt`; it gets SIGTERM if the sweep dies (PR_SET_PDEATHSIG), so it stops at a
checkpoint instead of training on for a sweep that is gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ft_accum.core.batch_arithmetic import BatchPlan

OOM_MARKERS = ("out of memory", "DefaultCPUAllocator: can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED")


def command_for(sweep: dict, run: dict, run_dir: Path) -> list[str]:
    """The real `accelerate launch` command line, through `ft-accum launch` (Accelerate's own launch,
    which also waits for the recipe's checkpoint at a stop signal): a list, never a shell string."""
    launch = [sys.executable, "-m", "ft_accum.cli.main", "launch"]
    if sweep["accelerate_config"]:
        launch += ["--config_file", sweep["accelerate_config"]]
    args = [f"--{k}={v}" for k, v in run["args"].items()]
    args.append(f"--output_dir={run_dir}")
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").glob("step_*")):
        args.append("--resume_from_checkpoint=latest")
    # The sweep file's base is the run's config: not the recipe's shipped one under it.
    return [*launch, sweep["recipe"], "--config=none", *args]


def replan_for_memory(args: dict[str, Any], recipe_defaults_micro: int) -> dict[str, Any]:
    """Half the micro-batch, twice the accumulation: the effective batch (and so the LR) stay the same."""
    micro = int(args.get("per_device_train_batch_size", recipe_defaults_micro))
    accumulation = int(args.get("gradient_accumulation_steps", 1))
    smaller = BatchPlan(micro, accumulation, 1).shrunk()
    new_micro, new_accumulation = smaller.micro, smaller.accumulation
    replanned = {**args, "per_device_train_batch_size": new_micro}
    if "gradient_accumulation_steps" in args or "effective_batch_size" not in args:
        replanned["gradient_accumulation_steps"] = new_accumulation
    return replanned


def default_micro(recipe: Path) -> int:
    """The recipe's own default micro-batch, as its parser gives it with no config (a sweep's runs
    pass `--config=none` and their own settings: `command_for`)."""
    from ft_accum.training.recipe_modules import recipe_arguments

    return recipe_arguments(recipe, ["--config", "none"])[1].per_device_train_batch_size


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants, read from /proc (torchrun workers live in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def kill_run(process: subprocess.Popen) -> None:
    """Kill the run's whole process tree by id: torchrun puts each worker in a session of its own,
    so its process group alone would leave workers holding the GPU."""
    pids = process_tree(process.pid) if Path("/proc").is_dir() else [process.pid]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM when the sweep dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG).
    `ft-accum launch` passes it to the recipe, which finishes its update and leaves a checkpoint, so a
    run is never left training for a sweep that is gone (the next sweep resumes it)."""
    os.setsid()  # a session of its own: Ctrl-C at the sweep's terminal is the sweep's to handle
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a killed sweep leaves the run going
        pass


def launch_and_watch(
    command: list[str], run_dir: Path, timeout: float | None, watch
) -> tuple[int | None, float, bool]:
    """Run `command` with its output appended to run_dir/log.txt, calling `watch(process, began)` about
    twice a second; return (exit code, wall seconds, timed out). A run past `timeout` is killed.

    On any exception in the sweep (Ctrl-C, a SIGTERM to the sweep, an error in `watch`) the run is
    sent SIGTERM and waited for, so it stops at a checkpoint, and the exception goes on."""
    began = time.monotonic()
    with open(run_dir / "log.txt", "a") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_stop_with_parent)
        try:
            while process.poll() is None:
                if timeout and time.monotonic() - began > timeout:
                    kill_run(process)
                    return process.returncode, time.monotonic() - began, True
                watch(process, began)
                time.sleep(0.5)
        except BaseException:
            stop_gracefully(process)
            raise
        finally:
            if sys.stdout.isatty():  # end the live progress line
                print(flush=True)
    return process.returncode, time.monotonic() - began, False


def stop_gracefully(process: subprocess.Popen, grace_seconds: float = 600) -> None:
    """SIGTERM to the run's launcher (`ft-accum launch` passes it on and waits for the checkpoint);
    SIGKILL to the whole tree if it is not done in `grace_seconds`."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        kill_run(process)


class ProgressLine:
    """One live line on a terminal; in a log file, a line per new update at most every 30 s."""

    def __init__(self):
        self.last_update, self.last_print, self.interactive = -1, 0.0, sys.stdout.isatty()

    def show(self, update: int, line: str) -> None:
        if self.interactive:
            print("\r" + line.ljust(110), end="", flush=True)
        elif update != self.last_update and time.monotonic() - self.last_print >= 30:
            print(line, flush=True)
            self.last_update, self.last_print = update, time.monotonic()


def error_line(log: Path) -> str:
    """The recipe's `error: ...` line, else the last line that names an exception, else the log's last line."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for line in reversed(lines):
        if line.startswith("error: "):
            return line
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception)\b", line):
            return line
    return lines[-1] if lines else "(empty log)"
