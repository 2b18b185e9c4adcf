"""Learning-rate scaling tied to the effective batch.

`learning_rate` is the LR that is right at `base_batch_size`. The scaled LR depends on the
effective batch B only, never on how B is split into micro-batches, accumulation steps and
processes:

    none:   lr
    linear: lr × B / base          Goyal et al. 2017, arXiv:1706.02677 (SGD)
    sqrt:   lr × sqrt(B / base)    Krizhevsky 2014, arXiv:1404.5997; Malladi et al. 2022,
                                   arXiv:2205.10287 (the square-root rule for Adam)
    auto:   sqrt for Adam-family optimizers, linear for SGD
"""

from __future__ import annotations

import math

from ft_accum.core.errors import ConfigError

POLICIES = ("none", "linear", "sqrt", "auto")


def resolve_lr_policy(policy: str, optim: str) -> str:
    """Turn `auto` into the rule that fits the optimizer: sqrt for Adam-family, linear for SGD."""
    if policy not in POLICIES:
        raise ConfigError(f"--lr_scaling must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy != "auto":
        return policy
    name = optim.lower()
    if "adam" in name or "lion" in name:
        return "sqrt"
    if "sgd" in name:
        return "linear"
    raise ConfigError(f"--lr_scaling auto does not know optimizer {optim!r}; choose --lr_scaling linear or sqrt")


def scale_learning_rate(
    learning_rate: float,
    effective_batch_size: int,
    base_batch_size: int | None,
    policy: str,
    optim: str = "adamw_torch",
) -> float:
    """The LR for `effective_batch_size`, given that `learning_rate` is right at `base_batch_size`.

    With no `base_batch_size`, the LR is returned unscaled whatever the policy.
    """
    rule = resolve_lr_policy(policy, optim)
    if base_batch_size is None or rule == "none":
        return learning_rate
    if base_batch_size <= 0:
        raise ConfigError(f"--base_batch_size must be ≥ 1, got {base_batch_size}")
    ratio = effective_batch_size / base_batch_size
    if rule == "linear":
        return learning_rate * ratio
    return learning_rate * math.sqrt(ratio)


def describe_lr_scaling(
    learning_rate: float,
    scaled_learning_rate: float,
    effective_batch_size: int,
    base_batch_size: int | None,
    policy: str,
    optim: str,
) -> str:
    """One line for the start-of-run banner."""
    if base_batch_size is None:
        return f"{learning_rate:g} (not scaled: no --base_batch_size given)"
    rule = resolve_lr_policy(policy, optim)
    shown = f"{policy} → {rule}" if policy == "auto" else rule
    return (
        f"{learning_rate:g} at batch {base_batch_size} → {scaled_learning_rate:.4g} at batch "
        f"{effective_batch_size} ({shown})"
    )
