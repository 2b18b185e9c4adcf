"""The run's updates, planned before the first one: how many windows each epoch holds, the LR
scheduler sized in those updates (not in micro-batches), and, under `--accumulation_schedule`, the
effective batch of each window as it starts (see core/accumulation_schedule.py for the formulas).

Without a schedule it plans fixed windows and changes nothing, so every run takes the same path.
`training/windows.py` asks it for each window's plan (`at_window_start`) and how many LR-scheduler
steps the window stands for (`lr_steps`); the one place the effective batch changes mid-run is here.
"""

from __future__ import annotations

from ft_accum.core.accumulation_schedule import (
    AccumulationSchedule,
    check_schedule,
    next_effective_batch,
    plan_windows,
    scheduler_advance,
)
from ft_accum.core.lr_schedule import build_lr_scheduler


def set_peak_learning_rate(optimizer, lr_scheduler, learning_rate: float) -> None:
    """Make `learning_rate` the peak LR of a running LambdaLR-style scheduler, from now on.

    The scheduler multiplies its `base_lrs` by the schedule factor, so both are replaced and the
    current LR is rescaled by the same ratio; warmup and decay carry on where they were. A group
    with an `lr_ratio` (LoRA+'s B matrices) keeps that ratio to the peak.
    """
    scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # Accelerate wraps it
    for i, group in enumerate(optimizer.param_groups):
        peak = learning_rate * group.get("lr_ratio", 1.0)
        group["lr"] *= peak / scheduler.base_lrs[i]
        group["initial_lr"] = peak
        scheduler.base_lrs[i] = peak
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


class UpdatePlan:
    """The run's windows planned from its (parsed) `schedule`, or fixed ones without, and its LR scheduler
    over them (`lr_scheduler`, prepared by `accelerator`). Build it after `accelerator.prepare`: the
    prepared dataloader holds this process's share of the batches, and the optimizer is the prepared one."""

    def __init__(
        self,
        accelerator,
        optimizer,
        plan,
        batches_per_epoch: int,
        *,
        schedule: AccumulationSchedule | None,
        num_train_epochs: int,
        max_train_steps: int | None,
        lr_scheduler_type: str,
        num_warmup_steps: int,
        scaled_learning_rate,
    ):
        """`scaled_learning_rate(effective_batch)` is the peak LR for an effective batch (--lr_scaling).

        `lr_scheduler` is --lr_scheduler_type over the planned updates (see lr_schedule). A change of the
        effective batch re-applies --lr_scaling to it. Under `adaptive`, each `step()` advances it by
        the starting-batch updates the current window stands for (`lr_steps`), so the LR follows the
        samples seen and a checkpoint holds it where it is."""
        self.start = plan.effective  # the run's starting effective batch
        self.optimizer, self.scaled_learning_rate, self.schedule = optimizer, scaled_learning_rate, schedule
        check_schedule(self.schedule, plan.micro, plan.processes, plan.effective)
        self.windows = plan_windows(
            batches_per_epoch, num_train_epochs, plan.micro, plan.processes, self.start, self.schedule, max_train_steps
        )
        self.num_update_steps = sum(map(len, self.windows))
        self.num_epochs = len(self.windows)
        self.prepared_lr_scheduler = accelerator.prepare(
            build_lr_scheduler(lr_scheduler_type, optimizer, num_warmup_steps, self.num_update_steps, plan.processes)
        )
        self.stepped = None  # the adaptive schedule's LR scheduler
        if self.schedule is not None and self.schedule.unit == "adaptive":
            self.stepped = SteppedPerSamples(self.prepared_lr_scheduler)
        self.lr_scheduler = self.stepped or self.prepared_lr_scheduler

    def at_window_start(self, accelerator, plan, state, *, noise=None):
        """The plan of the window about to start; a change re-applies --lr_scaling to the new effective batch.
        `noise` (a NoiseScaleMeter or None) gives an adaptive schedule its measurement."""
        if self.schedule is None:
            return plan
        target = next_effective_batch(
            self.schedule,
            self.start,
            state.step,
            state.epoch,
            state.effective_batch_size,
            state.last_change,
            noise.in_samples(state) if noise is not None else None,
        )
        state.change_effective_batch(target)
        if target == plan.effective:  # else: a change, or the resume of a run that changed
            return plan
        plan = plan.resplit(target)
        learning_rate = self.scaled_learning_rate(target)
        set_peak_learning_rate(self.optimizer, self.prepared_lr_scheduler, learning_rate)
        accelerator.print(f"update {state.step}: effective batch {plan.describe()}, peak lr {learning_rate:.3g}")
        return plan

    def lr_steps(self, window) -> int:
        """The LR-scheduler steps the update `window` stands for (`scheduler_advance`: one, or under `adaptive`
        its samples over the starting batch's, read from the window before it runs); it takes that many."""
        if self.schedule is None or self.schedule.unit != "adaptive":
            return 1
        steps = scheduler_advance(self.schedule, float(window.counts[-2]), self.start)
        if self.stepped is not None:
            self.stepped.steps_per_call = steps
        return steps


class SteppedPerSamples:
    """An adaptive schedule's LR scheduler: `step()` steps the prepared scheduler `steps_per_call` times
    (the starting-batch updates the current window replaces); everything else is the scheduler's."""

    def __init__(self, scheduler):
        self.scheduler, self.steps_per_call = scheduler, 1

    def step(self, *args, **kwargs) -> None:
        for _ in range(self.steps_per_call):
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)
