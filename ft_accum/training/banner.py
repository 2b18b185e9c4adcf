"""The start-of-run banner: the batch arithmetic and what it implies, before any compute is spent."""

from __future__ import annotations

from ft_accum.core.batch_arithmetic import BatchPlan


def format_banner(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    num_processes: int,
    lr_line: str,
    mixed_precision: str,
    gradient_checkpointing: bool,
    num_update_steps: int,
    num_train_epochs: int,
    updates_per_epoch: int,
    mean_tokens_per_sample: float | None = None,
    extra: dict[str, str] | None = None,
    unit: str = "samples",
) -> str:
    """A few aligned lines, e.g.

    batch        8 micro × 4 accumulation × 1 process = 32 samples per update
    learning rate 5e-05 at batch 32 → 5e-05 at batch 32 (sqrt)
    ...
    """
    plan = BatchPlan(per_device_train_batch_size, gradient_accumulation_steps, num_processes)
    effective = plan.effective
    rows = {
        "batch": plan.describe(unit),
        "learning rate": lr_line,
        "precision": mixed_precision if mixed_precision != "no" else "fp32",
        "grad checkpointing": "on" if gradient_checkpointing else "off",
        "updates": f"{num_update_steps} optimizer updates ({updates_per_epoch} per epoch, {num_train_epochs} epoch{'s' if num_train_epochs != 1 else ''})",
    }
    if mean_tokens_per_sample is not None:
        rows["tokens per update"] = (
            f"≈{effective * mean_tokens_per_sample:,.0f} ({mean_tokens_per_sample:.0f} non-pad tokens per {unit.rstrip('s')} on average)"
        )
    rows.update(extra or {})
    width = max(len(k) for k in rows)
    lines = [f"  {k.ljust(width)}  {v}" for k, v in rows.items()]
    rule = "─" * max(len(line) for line in lines)
    return "\n".join(["ft-accum run", rule, *lines, rule])
