"""Scheduler length in optimizer updates, not in micro-batches.

Accelerate's `by_feature/gradient_accumulation.py` sizes the schedule in micro-batches, so it
decays over only 1/N of its length. Two facts fix it:

1. The run makes `num_update_steps` optimizer updates (see batch_arithmetic.num_update_steps).
2. A scheduler passed through `accelerator.prepare` steps `num_processes` times per update
   (accelerate/scheduler.py, AcceleratedScheduler.step, when `split_batches=False`), and not
   at all on micro-batches that do not sync.

So the underlying scheduler is built with `num_update_steps × num_processes` steps, and the
warmup likewise, which makes it reach its final LR exactly at the last update.
"""

from __future__ import annotations

import torch


def scheduler_steps(num_updates: int, num_processes: int, split_batches: bool = False) -> int:
    """Calls the prepared scheduler sees for `num_updates` optimizer updates."""
    return num_updates if split_batches else num_updates * num_processes


def build_lr_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    num_warmup_steps: int,
    num_update_steps: int,
    num_processes: int,
    split_batches: bool = False,
) -> torch.optim.lr_scheduler.LRScheduler:
    """A `transformers.get_scheduler` schedule whose length and warmup are in optimizer updates.

    Pass the result through `accelerator.prepare`; it then ends exactly at the last update.
    """
    # Imported here: transformers.optimization pulls in its Trainer utilities (and with them peft
    # and bitsandbytes when installed), seconds that `ft-accum sweep` and `--help` do not need.
    from transformers import get_scheduler

    return get_scheduler(
        name,
        optimizer=optimizer,
        num_warmup_steps=scheduler_steps(num_warmup_steps, num_processes, split_batches),
        num_training_steps=scheduler_steps(num_update_steps, num_processes, split_batches),
    )
