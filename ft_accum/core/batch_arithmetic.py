"""Batch arithmetic: the effective batch and how it splits into micro-batches.

    effective_batch_size = per_device_train_batch_size × gradient_accumulation_steps × num_processes

The user states the effective batch (it is what shapes convergence); the accumulation steps are
derived from it. Giving the accumulation steps directly is also allowed, but not both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ft_accum.core.errors import ConfigError


def check_accumulation_settings(gradient_accumulation_steps: int | None, effective_batch_size: int | None) -> None:
    """Reject settings that are wrong whatever the hardware: both given, or a value ≤ 0."""
    if gradient_accumulation_steps is not None and effective_batch_size is not None:
        raise ConfigError(
            f"both --gradient_accumulation_steps ({gradient_accumulation_steps}) and "
            f"--effective_batch_size ({effective_batch_size}) were given; give only one "
            "(the effective batch is usually the one you mean)"
        )
    if gradient_accumulation_steps is not None and gradient_accumulation_steps <= 0:
        raise ConfigError(
            f"--gradient_accumulation_steps must be ≥ 1, got {gradient_accumulation_steps}; use 1 for no accumulation"
        )
    if effective_batch_size is not None and effective_batch_size <= 0:
        raise ConfigError(f"--effective_batch_size must be ≥ 1, got {effective_batch_size}")


def resolve_gradient_accumulation_steps(
    per_device_train_batch_size: int,
    num_processes: int,
    gradient_accumulation_steps: int | None = None,
    effective_batch_size: int | None = None,
) -> int:
    """Return the accumulation steps N such that micro × N × processes = effective.

    With neither setting given, N = 1. A non-divisible effective batch is a ConfigError that
    suggests the nearest effective batches which do divide, and the micro-batches that would.
    """
    check_accumulation_settings(gradient_accumulation_steps, effective_batch_size)
    if per_device_train_batch_size <= 0:
        raise ConfigError(f"--per_device_train_batch_size must be ≥ 1, got {per_device_train_batch_size}")
    if num_processes <= 0:
        raise ConfigError(f"the number of processes must be ≥ 1, got {num_processes}")
    if effective_batch_size is None:
        return gradient_accumulation_steps or 1
    per_window = per_device_train_batch_size * num_processes
    if effective_batch_size % per_window:
        lower = (effective_batch_size // per_window) * per_window
        upper = lower + per_window
        nearest = " or ".join(str(v) for v in (lower, upper) if v > 0)
        micro = divisors_fitting(effective_batch_size // num_processes, per_device_train_batch_size)
        hint = f"--effective_batch_size {nearest}"
        if effective_batch_size % num_processes == 0 and micro:
            hint += f", or --per_device_train_batch_size {micro}"
        raise ConfigError(
            f"--effective_batch_size {effective_batch_size} is not divisible by "
            f"per_device_train_batch_size {per_device_train_batch_size} × {num_processes} "
            f"process(es) = {per_window}; use {hint}"
        )
    return effective_batch_size // per_window


def micro_batches_for(effective_batch_size: int, num_processes: int = 1) -> list[int]:
    """Every micro-batch that splits the effective batch exactly: the divisors of effective / processes
    (each with accumulation = effective / (micro × processes)). A ConfigError if the processes don't divide it."""
    if effective_batch_size < 1 or effective_batch_size % num_processes:
        raise ConfigError(
            f"--effective_batch_size {effective_batch_size} does not split over {num_processes} process(es); "
            f"use a multiple of {num_processes}"
        )
    per_process = effective_batch_size // num_processes
    return [m for m in range(1, per_process + 1) if per_process % m == 0]


def divisors_fitting(n: int, at_most: int) -> int | None:
    """The largest divisor of n that is ≤ at_most (a micro-batch that still fits), or None."""
    for d in range(min(n, at_most), 0, -1):
        if n % d == 0:
            return d
    return None


def effective_batch_size(
    per_device_train_batch_size: int, gradient_accumulation_steps: int, num_processes: int
) -> int:
    """micro × accumulation × processes."""
    return per_device_train_batch_size * gradient_accumulation_steps * num_processes


def num_update_steps(
    batches_per_epoch: int,
    gradient_accumulation_steps: int,
    num_train_epochs: int,
    max_train_steps: int | None = None,
) -> int:
    """Optimizer updates in the run: ceil(batches_per_epoch / N) × epochs, or max_train_steps.

    `batches_per_epoch` is per process, i.e. the length of the *prepared* dataloader. The ceil
    counts the incomplete last window of each epoch, which still makes one update.
    """
    if batches_per_epoch <= 0:
        raise ConfigError("the training set gives no batches; check the data and --max_train_samples")
    if max_train_steps is not None:
        return max_train_steps
    return updates_per_epoch(batches_per_epoch, gradient_accumulation_steps) * num_train_epochs


def updates_per_epoch(batches_per_epoch: int, gradient_accumulation_steps: int) -> int:
    """ceil(batches_per_epoch / N): the last, incomplete window of an epoch is an update too."""
    return math.ceil(batches_per_epoch / gradient_accumulation_steps)


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer update is split: `micro` samples per micro-batch, `accumulation`
    micro-batches per update, on `processes` processes. Frozen: a change is a new plan; each
    window hands its own micro-batch count to the Accelerator (training/windows.py).
    """

    micro: int
    accumulation: int
    processes: int

    @property
    def effective(self) -> int:
        """micro × accumulation × processes: the samples in one update."""
        return effective_batch_size(self.micro, self.accumulation, self.processes)

    @classmethod
    def from_settings(
        cls,
        per_device_train_batch_size: int,
        num_processes: int,
        gradient_accumulation_steps: int | None = None,
        effective_batch_size: int | None = None,
    ) -> BatchPlan:
        """The plan for the user's settings; a non-divisible effective batch is a ConfigError with the fix."""
        accumulation = resolve_gradient_accumulation_steps(
            per_device_train_batch_size, num_processes, gradient_accumulation_steps, effective_batch_size
        )
        return cls(per_device_train_batch_size, accumulation, num_processes)

    def resplit(self, effective: int) -> BatchPlan:
        """The same micro-batch and processes, the accumulation that makes `effective` (schedules)."""
        return BatchPlan.from_settings(self.micro, self.processes, effective_batch_size=effective)

    def shrunk(self) -> BatchPlan:
        """The micro-batch divided by its smallest prime factor p, the accumulation × p: the same
        effective batch in smaller pieces (the out-of-memory retry). Micro-batch 1 cannot shrink."""
        if self.micro <= 1:
            raise ConfigError(
                "out of memory at micro-batch 1, so the micro-batch cannot shrink further; try --gradient_checkpointing, "
                "a shorter --max_seq_length/--block_size, LoRA, or bf16 (ft-accum plan predicts what fits)"
            )
        p = next(d for d in range(2, self.micro + 1) if self.micro % d == 0)
        return BatchPlan(self.micro // p, self.accumulation * p, self.processes)

    def describe(self, unit: str = "samples") -> str:
        """`8 micro × 4 accumulation × 1 process = 32 samples per update`."""
        return (
            f"{self.micro} micro × {self.accumulation} accumulation × {self.processes} "
            f"process{'es' if self.processes != 1 else ''} = {self.effective} {unit} per update"
        )
