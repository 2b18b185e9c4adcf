"""Preference losses (DPO, SimPO, ORPO) as sums over pairs, so that a window's mean is exact.

Each loss is a mean over pairs of a function of per-sequence log-probabilities, plus (ORPO) a
mean over the chosen tokens. `loss / N` over micro-batches of unequal pairs or tokens gets each
normaliser wrong (issue 28: TRL's DPO update off by 100% at 3 × 2 on 10 pairs, ORPO by 2.2% at
2 × 4). Here every function returns the micro-batch's *sums*; the recipe divides by the window's
totals over all processes, both counted before the window's first forward (training/windows.py:
the pairs through `window.scale`, ORPO's chosen tokens through `window.extra_counts`).

Notation, for pair i: π_c, π_r the policy's summed log-probabilities of the chosen and rejected
response tokens, ρ_c, ρ_r the reference's, |c|, |r| their token counts, σ the logistic function.

- DPO (Rafailov et al. 2023, eq. 7):     ℓ_i = −log σ(β[(π_c − ρ_c) − (π_r − ρ_r)]),  mean over pairs.
- SimPO (Meng et al. 2024, eq. 6):       ℓ_i = −log σ(β π_c/|c| − β π_r/|r| − γ),      mean over pairs.
- ORPO (Hong et al. 2024, eqs. 2–6):     L = Σ_i NLL_c,i / Σ_i |c_i| − λ · mean_i log σ(log odds_i),
  with log odds_i = log(p_c / (1 − p_c)) − log(p_r / (1 − p_r)) and log p = π/|·| (the mean
  token log-probability), as TRL's ORPOTrainer computes it.

Rewards, as TRL logs them: DPO β(π − ρ), SimPO β π/|·|, ORPO λ π/|·|; reward accuracy is the
fraction of pairs whose chosen reward is higher, and the margin the mean of chosen − rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("dpo", "simpo", "orpo")
# The papers' defaults: DPO β = 0.1; SimPO β = 2.0 with γ/β = 0.5 (princeton-nlp/SimPO's
# training configs); ORPO λ = 0.1 (TRL's ORPOConfig.beta, the paper's Phi-2 and Llama-2 runs).
DEFAULT_BETA = {"dpo": 0.1, "simpo": 2.0, "orpo": 0.1}
DEFAULT_SIMPO_GAMMA = 1.0


@dataclass
class PairTerms:
    """One micro-batch's per-pair terms; the sums the window needs are properties."""

    pair_losses: torch.Tensor  # ℓ_i, the pair-mean term (with the gradient)
    chosen_nll: torch.Tensor  # ORPO: each chosen response's summed NLL (with the gradient); zeros otherwise
    chosen_tokens: torch.Tensor
    chosen_rewards: torch.Tensor  # detached
    rejected_rewards: torch.Tensor

    @property
    def loss_sum(self) -> torch.Tensor:
        return self.pair_losses.sum()

    @property
    def nll_sum(self) -> torch.Tensor:
        return self.chosen_nll.sum()

    @property
    def correct(self) -> torch.Tensor:
        """Pairs whose chosen reward beats the rejected one."""
        return (self.chosen_rewards > self.rejected_rewards).sum()

    def reward_sums(self) -> torch.Tensor:
        """[Σ chosen rewards, Σ rejected rewards, correct pairs, pairs], float64: what a window adds up."""
        pairs = self.chosen_rewards.new_tensor(len(self.chosen_rewards))
        return torch.stack([self.chosen_rewards.sum(), self.rejected_rewards.sum(), self.correct, pairs]).double()


def reward_means(sums: list[float]) -> dict[str, float]:
    """metrics.jsonl's reward columns from a window's `reward_sums` over all its micro-batches and processes:
    each a mean over the window's pairs, and the margin Σ(r_chosen − r_rejected) / pairs."""
    chosen, rejected, correct, pairs = sums
    return {
        "rewards_chosen": chosen / pairs,
        "rewards_rejected": rejected / pairs,
        "reward_accuracy": correct / pairs,
        "reward_margin": (chosen - rejected) / pairs,
    }


def pair_terms(
    loss: str,
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float,
    reference_chosen: torch.Tensor | None = None,
    reference_rejected: torch.Tensor | None = None,
    simpo_gamma: float = DEFAULT_SIMPO_GAMMA,
) -> PairTerms:
    """`loss`'s terms for a micro-batch's pairs, from each sequence's summed log-probability of its
    response tokens and their count; the reference's for DPO only."""
    nll = torch.zeros_like(policy_chosen)
    if loss == "dpo":
        chosen_rewards = beta * (policy_chosen - reference_chosen)
        rejected_rewards = beta * (policy_rejected - reference_rejected)
        pair_losses = -F.logsigmoid(chosen_rewards - rejected_rewards)
    elif loss in ("simpo", "orpo"):
        chosen_mean = policy_chosen / chosen_tokens
        rejected_mean = policy_rejected / rejected_tokens
        chosen_rewards, rejected_rewards = beta * chosen_mean, beta * rejected_mean
        if loss == "simpo":
            pair_losses = -F.logsigmoid(chosen_rewards - rejected_rewards - simpo_gamma)
        else:
            # log(p / (1 − p)) with log p = the mean token log-prob; log1p(−exp(x)) is exact for x < 0.
            log_odds = (chosen_mean - rejected_mean) - (
                torch.log1p(-torch.exp(chosen_mean)) - torch.log1p(-torch.exp(rejected_mean))
            )
            pair_losses = -beta * F.logsigmoid(log_odds)
            nll = -policy_chosen
    else:
        raise ValueError(f"unknown preference loss {loss!r}; one of {', '.join(LOSSES)}")
    return PairTerms(pair_losses, nll, chosen_tokens, chosen_rewards.detach(), rejected_rewards.detach())
