"""Accumulation schedules: a run whose effective batch changes, at set points or adaptively.

Lightning's GradientAccumulationScheduler changes the accumulation at given epochs. Here the
schedule names effective batch sizes, the quantity that shapes training, so the same schedule
holds on one GPU or several:

    --accumulation_schedule "100:64,300:128"        64 samples per update from update 100, 128 from 300
    --accumulation_schedule "epoch1:64,epoch2:128"  the same at the start of epochs 1 and 2 (0-based)
    --accumulation_schedule adaptive                double it while the noise scale says so
    --accumulation_schedule "adaptive:max=256,factor=2,patience=10"

The run starts at --effective_batch_size (or --gradient_accumulation_steps). Each change
happens between two updates, so the sample order is the one of a fixed run: only the window
boundaries move. The LR-scaling policy is re-applied to the new effective batch.

`adaptive` follows Smith et al. 2018 ("Don't Decay the Learning Rate, Increase the Batch Size",
arXiv:1711.00489) with the noise scale B_simple of McCandlish et al. 2018 (arXiv:1812.06162) as
the signal: when B_simple exceeds the current effective batch by `factor`, the accumulation
doubles (up to `max`), at most once every `patience` updates so that the EMA can settle.

LR-scheduler length: a fixed schedule gives a known number of updates (`plan_windows`), and the
scheduler is sized to it. An adaptive run cannot know it in advance, so its scheduler counts in
updates of the starting batch, and each update advances it by the starting-batch updates it
replaces (`scheduler_advance`): the LR then follows the samples seen, ending at the last one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ft_accum.core.errors import ConfigError

FORMAT = (
    '"UPDATE:EFFECTIVE_BATCH,..." (e.g. "100:64,300:128"), "epochN:EFFECTIVE_BATCH,..." '
    '(e.g. "epoch1:64"), or "adaptive[:max=N,factor=F,patience=K]"'
)


@dataclass(frozen=True)
class AccumulationSchedule:
    unit: str  # "update", "epoch" or "adaptive"
    changes: tuple[tuple[int, int], ...] = ()  # (first update or epoch, effective batch), starts increasing
    max_effective_batch_size: int | None = None  # adaptive: the cap; None = 16 × the starting batch
    factor: float = 2.0  # adaptive: grow when noise scale > factor × effective batch
    patience: int = 10  # adaptive: updates between two changes


def parse_accumulation_schedule(text: str | None) -> AccumulationSchedule | None:
    """Parse the --accumulation_schedule string; a malformed one is a ConfigError showing the format."""
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    if text.split(":", 1)[0] == "adaptive":
        options = {}
        for item in filter(None, text.partition(":")[2].split(",")):
            key, _, value = item.strip().partition("=")
            if key not in ("max", "factor", "patience") or not value:
                raise ConfigError(
                    f"--accumulation_schedule {text!r}: unknown adaptive option {item.strip()!r}; the format is {FORMAT}"
                )
            options[key] = value
        try:
            schedule = AccumulationSchedule(
                "adaptive",
                max_effective_batch_size=int(options["max"]) if "max" in options else None,
                factor=float(options.get("factor", 2.0)),
                patience=int(options.get("patience", 10)),
            )
        except ValueError:
            raise ConfigError(
                f"--accumulation_schedule {text!r}: max and patience are integers, factor a number; the format is {FORMAT}"
            ) from None
        if schedule.factor <= 0 or schedule.patience < 1 or (schedule.max_effective_batch_size or 1) < 1:
            raise ConfigError(f"--accumulation_schedule {text!r}: max ≥ 1, factor > 0 and patience ≥ 1 are required")
        return schedule
    changes, units = [], set()
    for item in text.split(","):
        match = re.fullmatch(r"\s*(epoch)?(\d+)\s*:\s*(\d+)\s*", item)
        if not match:
            raise ConfigError(
                f"--accumulation_schedule {text!r}: cannot read {item.strip()!r}; the format is {FORMAT}"
            )
        units.add("epoch" if match[1] else "update")
        changes.append((int(match[2]), int(match[3])))
    if len(units) > 1:
        raise ConfigError(f"--accumulation_schedule {text!r} mixes updates and epochs; use one or the other")
    starts = [start for start, _ in changes]
    if starts != sorted(set(starts)):
        raise ConfigError(f"--accumulation_schedule {text!r}: the starts must increase, each given once")
    if starts[0] == 0:
        raise ConfigError(
            f"--accumulation_schedule {text!r}: the run starts at --effective_batch_size; list only the changes (starts ≥ 1)"
        )
    if any(size < 1 for _, size in changes):
        raise ConfigError(f"--accumulation_schedule {text!r}: effective batch sizes must be ≥ 1")
    return AccumulationSchedule(units.pop(), tuple(changes))


def check_schedule(
    schedule: AccumulationSchedule | None,
    per_device_train_batch_size: int,
    num_processes: int,
    start_effective_batch_size: int,
) -> None:
    """Every scheduled effective batch must split into micro × accumulation × processes; the adaptive cap must be ≥ the start."""
    if schedule is None:
        return
    per_window = per_device_train_batch_size * num_processes
    if schedule.unit == "adaptive":
        cap = schedule.max_effective_batch_size
        if cap is not None and cap < start_effective_batch_size:
            raise ConfigError(
                f"--accumulation_schedule adaptive: max={cap} is below the starting effective batch {start_effective_batch_size}; "
                f"use max={2 * start_effective_batch_size} or more"
            )
        return
    for start, size in schedule.changes:
        if size % per_window:
            lower, upper = size // per_window * per_window, (size // per_window + 1) * per_window
            where = f"epoch{start}" if schedule.unit == "epoch" else str(start)
            nearest = " or ".join(f"{where}:{v}" for v in (lower, upper) if v > 0)
            raise ConfigError(
                f"--accumulation_schedule entry {where}:{size} is not divisible by per_device_train_batch_size "
                f"{per_device_train_batch_size} × {num_processes} process(es) = {per_window}; use {nearest}"
            )


def scheduled_effective_batch(
    schedule: AccumulationSchedule | None, start_effective_batch_size: int, update: int, epoch: int
) -> int:
    """The effective batch of the update after `update` completed ones, in `epoch` (fixed schedules; else the start)."""
    current = start_effective_batch_size
    if schedule is None or schedule.unit == "adaptive":
        return current
    position = epoch if schedule.unit == "epoch" else update
    for start, size in schedule.changes:
        if position >= start:
            current = size
    return current


def plan_windows(
    batches_per_epoch: int,
    num_train_epochs: int,
    per_device_train_batch_size: int,
    num_processes: int,
    start_effective_batch_size: int,
    schedule: AccumulationSchedule | None,
    max_train_steps: int | None = None,
) -> list[list[int]]:
    """Micro-batches per update, epoch by epoch, as the training loop will take them.

    A window never spans two epochs (Accelerate syncs at the end of the dataloader), so each
    epoch ends with a short window when its batches do not divide. An adaptive schedule is
    planned at its starting batch: its LR scheduler counts in those updates.
    """
    if batches_per_epoch <= 0:
        raise ConfigError("the training set gives no batches; check the data and --max_train_samples")
    plan, update, epoch = [], 0, 0
    # --max_train_steps overrides the epochs, in either direction (as in batch_arithmetic.num_update_steps).
    while (epoch < num_train_epochs) if max_train_steps is None else (update < max_train_steps):
        windows, left = [], batches_per_epoch
        while left > 0 and (max_train_steps is None or update < max_train_steps):
            effective = scheduled_effective_batch(schedule, start_effective_batch_size, update, epoch)
            windows.append(min(effective // (per_device_train_batch_size * num_processes), left))
            left -= windows[-1]
            update += 1
        plan.append(windows)
        epoch += 1
    return plan


def scheduler_advance(
    schedule: AccumulationSchedule | None, window_samples: int, start_effective_batch_size: int
) -> int:
    """LR-scheduler steps for one update of `window_samples` samples (all processes).

    One for a fixed schedule (it is sized in real updates). Under `adaptive` the scheduler counts
    updates of the starting batch B₀: a window of k·B₀ samples replaces k of them, and a short last
    window of the epoch replaces one, so the count over an epoch is the one `plan_windows` gave.
    """
    if schedule is None or schedule.unit != "adaptive":
        return 1
    return math.ceil(window_samples / start_effective_batch_size)


def adaptive_effective_batch(
    schedule: AccumulationSchedule,
    measured_noise_scale: float | None,
    effective_batch_size: int,
    start_effective_batch_size: int,
    updates_since_change: int,
) -> int:
    """Double the effective batch when the noise scale exceeds `factor` × it (Smith et al. 2018).

    Powers of two of the start, up to the cap; no change within `patience` updates of the last
    (or of the start) or before the first measurement (None). An infinite noise scale (the |G|²
    estimate is not yet positive: noise dominates) counts as exceeding any batch.
    """
    cap = schedule.max_effective_batch_size or 16 * start_effective_batch_size
    if measured_noise_scale is None or updates_since_change < schedule.patience:
        return effective_batch_size
    if measured_noise_scale > schedule.factor * effective_batch_size and 2 * effective_batch_size <= cap:
        return 2 * effective_batch_size
    return effective_batch_size


def next_effective_batch(
    schedule: AccumulationSchedule,
    start_effective_batch_size: int,
    update: int,
    epoch: int,
    effective_batch_size: int,
    last_change: int,
    measured_noise_scale: float | None,
) -> int:
    """The effective batch of the window that starts after `update` completed updates, in `epoch`.

    Fixed schedules read it off the schedule; `adaptive` decides from the measured noise scale
    (None before the first measurement), given the current batch and the update of the last change.
    """
    if schedule.unit != "adaptive":
        return scheduled_effective_batch(schedule, start_effective_batch_size, update, epoch)
    return adaptive_effective_batch(
        schedule, measured_noise_scale, effective_batch_size, start_effective_batch_size, update - last_change
    )
