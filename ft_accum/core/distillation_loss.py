"""Knowledge-distillation losses per target token: forward KL, reverse KL, the generalized JSD, and CE (issue 56).

With temperature τ, the student's and the teacher's next-token distributions at a position are
q = softmax(z_s / τ) and p = softmax(z_t / τ). GKD's generalized Jensen-Shannon divergence (Agarwal
et al. 2024, arXiv:2306.13649, eq. 1; TRL's `GKDTrainer.generalized_jsd_loss`) with β ∈ [0, 1]:

    M = β p + (1 − β) q,   JSD(β) = β KL(p ‖ M) + (1 − β) KL(q ‖ M),

whose limits are taken, as TRL does, as the divergences it tends to once rescaled:
β = 0 is the forward KL(p ‖ q) = Σ_v p_v (log p_v − log q_v) (Hinton et al. 2015, arXiv:1503.02531:
the student covers the teacher's mass), β = 1 the reverse KL(q ‖ p) (mode-seeking, as MiniLLM).
Hinton et al. scale the divergence by τ², so that its gradients keep their size as τ changes; with
`alpha` the ordinary cross-entropy on the data's token joins it:

    ℓ_t = (1 − α) τ² D_β(p_t ‖ q_t) + α CE(z_s, y_t).

The functions return ℓ for each position given (logits [N, V], computed in at least fp32); the update's loss is their sum
over its counted tokens on every micro-batch and process, ÷ their number (the window's scale).
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from ft_accum.core.errors import ConfigError


def check_distillation_settings(beta: float, temperature: float, alpha: float, lmbda: float = 0.0) -> None:
    """β, α and λ are fractions in [0, 1]; τ must be positive. Cross-entropy (α) is on the data's
    answers: with λ > 0 some answers are the student's own, and it would teach the student its samples."""
    for name, value in (("--beta", beta), ("--alpha", alpha), ("--lmbda", lmbda)):
        if not 0 <= value <= 1:
            raise ConfigError(f"{name} must be in [0, 1], got {value} (0 and 1 are the two ends of the mix)")
    if not temperature > 0:
        raise ConfigError(f"--temperature must be > 0, got {temperature} (1 leaves the distributions as they are)")
    if lmbda and alpha:
        raise ConfigError(
            f"--lmbda {lmbda} trains on the student's own answers, where --alpha {alpha}'s cross-entropy would teach "
            "the student its samples; add --alpha 0 (GKD's setting)"
        )


def describe(beta: float, temperature: float, alpha: float) -> str:
    """The banner's words for ℓ: which divergence, τ, and the share of cross-entropy."""
    name = "forward KL" if beta == 0 else "reverse KL" if beta == 1 else f"generalized JSD (β {beta:g})"
    divergence = f"{name} at τ {temperature:g}" + (f" (× τ² = {temperature**2:g})" if temperature != 1 else "")
    if alpha == 1:
        return "cross-entropy only (--alpha 1: no distillation)"
    return divergence if not alpha else f"{1 - alpha:g} × {divergence} + {alpha:g} × cross-entropy"


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Logits in fp32, or fp64 where they already are: a softmax over a vocabulary wants fp32's range."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def token_divergences(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """[N]: D_β(p ‖ q) at each position (the module docstring), from logits [N, V] at temperature τ."""
    log_q = F.log_softmax(at_least_fp32(student_logits) / temperature, dim=-1)
    log_p = F.log_softmax(at_least_fp32(teacher_logits) / temperature, dim=-1)
    if beta == 0:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if beta == 1:
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log1p(-beta)]), dim=0)
    return beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)


def distillation_token_losses(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    alpha: float = 0.0,
) -> torch.Tensor:
    """[N]: ℓ_t = (1 − α) τ² D_β + α CE(z_s, y_t) at each position (targets [N], already aligned)."""
    losses = (
        (1 - alpha)
        * temperature**2
        * token_divergences(student_logits, teacher_logits, beta=beta, temperature=temperature)
    )
    if alpha:
        losses = losses + alpha * F.cross_entropy(at_least_fp32(student_logits), targets, reduction="none")
    return losses


def student_samples(seed: int, update: int, sequence_ids: list[int], lmbda: float) -> list[bool]:
    """Which sequences of an update the student answers itself (GKD's on-policy fraction λ): sequence i is
    the student's when u(seed, update, i) < λ, u uniform in [0, 1) from a generator seeded by the three
    (Python's `random.Random` seeds from the string's SHA-512). The decision belongs to the sequence, so
    it is the same at any split into micro-batches and processes; TRL's `GKDTrainer` draws once per
    micro-batch (`random.random() <= lmbda`), so there the split decides which sequences are on-policy."""
    return [random.Random(f"{seed}:{update}:{i}").random() < lmbda for i in sequence_ids]
