"""GRPO-family losses (GRPO, DAPO, Dr. GRPO; GSPO's sequence-level ratio) as sums, so that an
update's mean is exact however its completions are split into micro-batches and processes.

Each loss is a normalised sum of per-token terms over the update's completions. TRL's `dapo`
(its default) divides each micro-batch by the *round's* average completion tokens per update and
`bnpo` (Unsloth's default) averages the micro-batches' token means: both change the update when
the completions' lengths vary (issue 43: bnpo 48% of the update off at 2 × 4, dapo 1.1% with one
round over two updates). Here each function returns a micro-batch's numerator and the items it
counts; the recipe divides the window's summed numerators by the window's items summed over all
processes, counted before the update's first forward (`loss_items`; training/generation_round.py's
windows), so every update has its own exact normaliser.

Notation: completion i of the update has tokens t = 1..|o_i| (m_it = 1 for a token that counts:
not padding, not after EOS, not in a truncated completion under `mask_truncated_completions`),
advantage Â_i, per-token importance ratio r_it = π(o_it) / π_old(o_it), and ℓ_it the clipped
surrogate below; N is the update's number of completions, L the `max_completion_length`.

- Advantages (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, §4.1.2): Â_i = (R_i − mean_g R) / std_g R
  over the G completions of i's prompt; Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) drops the
  division by the std (`scale_rewards` off).
- Clipped surrogate (PPO; DAPO's decoupled clip, Yu et al. 2025, arXiv:2503.14476, eq. 8):
  ℓ_it = −min(r_it Â_i, clip(r_it, 1 − ε_low, 1 + ε_high) Â_i), plus β · KL_it with the k3 estimator
  KL_it = exp(ρ_it − π_it) − (ρ_it − π_it) − 1 (DeepSeekMath eq. 4), ρ the reference's log-prob.
- GSPO (Zheng et al. 2025, arXiv:2507.18071, eq. 7): one ratio per sequence, the geometric mean of
  its token ratios, s_i = exp(Σ_t m_it (log π_it − log π_old,it) / Σ_t m_it), clipped per sequence.

The normalisers, each over the whole update:
- `grpo` (DeepSeekMath eq. 3):   L = (1/N) Σ_i (Σ_t m_it ℓ_it / Σ_t m_it)   items: completions;
- `dapo` (DAPO eq. 8):           L = Σ_it m_it ℓ_it / Σ_it m_it             items: completion tokens;
- `dr_grpo` (Dr. GRPO eq. 2):    L = Σ_it m_it ℓ_it / (N · L)               items: completions.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
STD_EPSILON = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0, not 0/0


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: bool = True) -> torch.Tensor:
    """Â_i = (R_i − mean of its group) / (std of its group + 1e-4), or without the division (Dr. GRPO).
    `rewards` holds whole groups of `num_generations` consecutive completions; std is the unbiased one, as TRL's."""
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {num_generations}")
    grouped = rewards.view(-1, num_generations)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + STD_EPSILON)
    return advantages.reshape(-1)


def log_importance_weights(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str = "token"
) -> torch.Tensor:
    """log r: per token (`token`), or GSPO's per sequence (`sequence`, shape [B, 1]: the token mean of the
    log ratios over the tokens that count)."""
    log_ratio = logps - old_logps
    if level == "token":
        return log_ratio
    if level == "sequence":
        mask = mask.to(log_ratio.dtype)
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)
    raise ValueError(f"unknown importance sampling level {level!r}; one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")


def clipped_surrogate(
    log_weights: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ℓ = −min(r Â, clip(r, 1 − ε_low, 1 + ε_high) Â), whether the clip was the min), per token."""
    ratio = torch.exp(log_weights)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    advantages = advantages.unsqueeze(-1)
    unclipped, clipped = ratio * advantages, clipped_ratio * advantages
    return -torch.min(unclipped, clipped), (clipped < unclipped).detach()


def kl_k3(logps: torch.Tensor, reference_logps: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(π ‖ π_ref) per token: exp(ρ − π) − (ρ − π) − 1 ≥ 0."""
    delta = reference_logps - logps
    return torch.exp(delta) - delta - 1


def grpo_sums(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`grpo`: (Σ_i of each completion's token mean, completions). A completion with no token that counts adds 0."""
    mask = mask.to(per_token.dtype)
    means = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return means.sum(), per_token.new_tensor(len(mask))


def dapo_sums(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`dapo`: (Σ_it m_it ℓ_it, Σ_it m_it): the update's token mean, once summed over micro-batches
    and processes."""
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum(), mask.sum()


def dr_grpo_sums(
    per_token: torch.Tensor, mask: torch.Tensor, max_completion_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`dr_grpo`: (Σ_it m_it ℓ_it / L, completions): a constant L for every completion, so no length bias."""
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / max_completion_length, per_token.new_tensor(len(mask))


def loss_items(loss_type: str, mask: torch.Tensor) -> torch.Tensor:
    """What `loss_type`'s update loss is a mean over, in one micro-batch: counted tokens (`dapo`: Σ m_it)
    or completions (`grpo`, `dr_grpo`). The same as the items `loss_sums` returns, known before the forward."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss type {loss_type!r}; one of {', '.join(LOSS_TYPES)}")
    return mask.sum() if loss_type == "dapo" else mask.new_tensor(len(mask))


def loss_sums(
    loss_type: str, per_token: torch.Tensor, mask: torch.Tensor, max_completion_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's (numerator, items) for `loss_type`; the update's loss is Σ numerators / Σ items."""
    if loss_type == "grpo":
        return grpo_sums(per_token, mask)
    if loss_type == "dapo":
        return dapo_sums(per_token, mask)
    if loss_type == "dr_grpo":
        return dr_grpo_sums(per_token, mask, max_completion_length)
    raise ValueError(f"unknown loss type {loss_type!r}; one of {', '.join(LOSS_TYPES)}")
