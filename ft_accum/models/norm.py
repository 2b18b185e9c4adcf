"""BatchNorm under gradient accumulation, and the two ways out.

Accumulation is exact only when every sample's loss depends on that sample alone. BatchNorm in
training mode breaks that: it normalises each *micro-batch* with that micro-batch's mean and
variance, so (micro 2 × accumulation 4) computes a different function, and different gradients,
than one batch of 8. Its running statistics also move once per micro-batch, N times per update.
(Ioffe & Szegedy 2015, arXiv:1502.03167; the accumulation caveat is in, e.g., Lightning's and
Hugging Face's accumulation guides.)

- `groupnorm`: replace each BatchNorm with GroupNorm (Wu & He 2018, arXiv:1803.08494), which
  normalises each sample over groups of channels: per-sample, so accumulation is exact. The
  affine weight and bias are kept; the running statistics are dropped. Best when training from
  scratch; a pretrained BN model loses the statistics its later layers were tuned to.
- `freeze`: keep BatchNorm in eval mode: it normalises with its running statistics, which stop
  moving. Per-sample again, so exact. The usual choice when fine-tuning a pretrained BN model.
- `keep`: leave it (a warning says what that means when accumulating).

Opacus converts BN to GroupNorm for differential privacy (per-sample gradients); the reason here
is the same property.
"""

from __future__ import annotations

import torch
from torch import nn

from ft_accum.core.errors import ConfigError

POLICIES = ("keep", "groupnorm", "freeze")


def find_batchnorm(model: nn.Module) -> list[str]:
    """Names of the BatchNorm (1d/2d/3d, SyncBatchNorm) modules in `model`."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]


def group_count(num_channels: int, max_groups: int = 32, min_channels_per_group: int = 4) -> int:
    """The most groups (≤ `max_groups`, Wu & He's default 32) that divide the channels into groups of ≥ 4.

    One channel per group (InstanceNorm) is degenerate where a feature map is 1×1, as it is at
    the end of a ResNet on small images: each group then holds one value, whose variance is 0.
    """
    upper = max(1, min(max_groups, num_channels // min_channels_per_group))
    return next(g for g in range(upper, 0, -1) if num_channels % g == 0)


def convert_batchnorm_to_groupnorm(model: nn.Module, max_groups: int = 32) -> int:
    """Replace every BatchNorm in `model` (in place) by a GroupNorm over the same channels; return how many.

    Groups: see `group_count`. The affine weight and bias
    are copied, so a freshly built model starts from the same parameters.
    """
    converted = 0
    for name in find_batchnorm(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bn = getattr(parent, child)
        gn = nn.GroupNorm(group_count(bn.num_features, max_groups), bn.num_features, eps=bn.eps, affine=bn.affine)
        gn = gn.to(device=bn.weight.device if bn.affine else None, dtype=bn.weight.dtype if bn.affine else None)
        if bn.affine:
            with torch.no_grad():
                gn.weight.copy_(bn.weight)
                gn.bias.copy_(bn.bias)
        setattr(parent, child, gn)
        converted += 1
    return converted


def _stay_in_eval_mode(module: nn.Module, args) -> None:
    module.training = False


def freeze_batchnorm(model: nn.Module) -> int:
    """Keep every BatchNorm in eval mode from now on, whatever `model.train()` says; return how many.

    A forward pre-hook resets `training` before each call, so the running statistics normalise
    and never update. The affine weight and bias still train.
    """
    names = find_batchnorm(model)
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(_stay_in_eval_mode)
    return len(names)


def apply_batchnorm_policy(
    model: nn.Module, policy: str, gradient_accumulation_steps: int, num_processes: int = 1
) -> str | None:
    """Apply --batchnorm to `model` (in place); return the line to print, if any.

    A policy that finds no BatchNorm is a notice, not an error. `keep` with accumulation (or
    several processes, where each normalises its own share) is a warning that names the fix.
    """
    if policy not in POLICIES:
        raise ConfigError(f"--batchnorm must be one of {', '.join(POLICIES)}, got {policy!r}")
    names = find_batchnorm(model)
    if not names:
        return (
            None
            if policy == "keep"
            else f"notice: --batchnorm {policy}: the model has no BatchNorm layers, nothing to change"
        )
    if policy == "groupnorm":
        return f"--batchnorm groupnorm: {convert_batchnorm_to_groupnorm(model)} BatchNorm layers replaced by GroupNorm (per-sample, exact under accumulation)"
    if policy == "freeze":
        return f"--batchnorm freeze: {freeze_batchnorm(model)} BatchNorm layers use their running statistics (frozen, exact under accumulation)"
    if gradient_accumulation_steps > 1 or num_processes > 1:
        return (
            f"warning: the model has {len(names)} BatchNorm layers in training mode. Each normalises one micro-batch of "
            f"{'its process' if num_processes > 1 else 'the window'} at a time, so this run is NOT equivalent to one batch of the "
            "effective size, and the running statistics move once per micro-batch. Use --batchnorm groupnorm (from scratch) "
            "or --batchnorm freeze (pretrained) for exact accumulation"
        )
    return None
