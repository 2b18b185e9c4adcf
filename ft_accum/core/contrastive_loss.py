"""In-batch-negatives contrastive losses for embedding models, one loss per anchor (issue 55).

With embeddings normalised to unit length, anchor i's scores against the update's candidates are
s_ij = scale · cos(a_i, c_j), where the candidates are every positive of the update and, when the
data has them, every hard negative after them: the positive of anchor i is column i, and every other
column is one of its negatives. So the batch size *is* the number of negatives, and a loss over a
micro-batch alone is not the loss of the update (training/embedding_cache.py makes it exact).

- InfoNCE / MultipleNegativesRankingLoss (van den Oord et al. 2018, arXiv:1807.03748; Henderson et al.
  2017, arXiv:1705.00652; sentence-transformers' `MultipleNegativesRankingLoss`, scale 20):
      ℓ_i = −log softmax_j(s_ij)_i,   the update's loss is Σ_i ℓ_i / (the update's anchors).
- Symmetric (CLIP, Radford et al. 2021, arXiv:2103.00020; sentence-transformers'
  `MultipleNegativesSymmetricRankingLoss`): the mean of the anchor→candidates term and the
  positive→anchors term (the hard negatives take part in the first only):
      ℓ_i = ½ (−log softmax_j(s_ij)_i − log softmax_k(scale · cos(p_i, a_k))_i).

Each function returns one loss per anchor; the update's summed loss is their sum over every process's
anchors, and the window divides it by their count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft_accum.core.errors import ConfigError

DEFAULT_SCALE = 20.0  # sentence-transformers' MultipleNegativesRankingLoss: 1 / temperature 0.05


def check_scale(scale: float) -> None:
    """The similarity scale (1 / temperature) must be positive: 0 makes every candidate equally likely."""
    if not scale > 0:
        raise ConfigError(f"--scale must be > 0, got {scale} (sentence-transformers' default is {DEFAULT_SCALE:g})")


def in_batch_scores(anchors: torch.Tensor, candidates: torch.Tensor, scale: float) -> torch.Tensor:
    """[A, C] = scale · aᵢ · cⱼ, in fp32: the cosine similarity of unit-length embeddings, scaled."""
    return scale * anchors.float() @ candidates.float().T


def info_nce_losses(
    anchors: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor | None = None, scale: float = DEFAULT_SCALE
) -> torch.Tensor:
    """[A]: ℓ_i = −log softmax_j(s_ij)_i for each anchor, the candidates being [positives; negatives]
    (anchor i's positive is column i). All [N, d], unit length."""
    candidates = positives if negatives is None else torch.cat([positives, negatives])
    targets = torch.arange(len(anchors), device=anchors.device)
    return F.cross_entropy(in_batch_scores(anchors, candidates, scale), targets, reduction="none")


def symmetric_info_nce_losses(
    anchors: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor | None = None, scale: float = DEFAULT_SCALE
) -> torch.Tensor:
    """[A]: ½ (anchor i → candidates + positive i → anchors): CLIP's loss, per anchor."""
    targets = torch.arange(len(anchors), device=anchors.device)
    backward = F.cross_entropy(in_batch_scores(positives, anchors, scale), targets, reduction="none")
    return (info_nce_losses(anchors, positives, negatives, scale) + backward) / 2


def contrastive_losses(
    anchors: torch.Tensor,
    positives: torch.Tensor,
    negatives: torch.Tensor | None = None,
    *,
    scale: float = DEFAULT_SCALE,
    symmetric: bool = False,
) -> torch.Tensor:
    """Each anchor's loss over the update's candidates, [A]: `symmetric_info_nce_losses` or
    `info_nce_losses`. Their sum, ÷ the update's anchors, is the update's loss. An update of one pair
    and no negative has loss 0 (one candidate): `check_negatives` refuses a run made of such updates."""
    loss = symmetric_info_nce_losses if symmetric else info_nce_losses
    return loss(anchors, positives, negatives, scale)


def negatives_per_anchor(effective_batch_size: int, hard_negatives: bool) -> int:
    """The candidates an anchor is told apart from: the update's other positives (E − 1), and with a
    hard-negative column every anchor's negative too (+ E)."""
    return effective_batch_size - 1 + (effective_batch_size if hard_negatives else 0)


def check_negatives(effective_batch_size: int, hard_negatives: bool) -> None:
    """An update needs a negative: an effective batch of one pair without a hard negative learns nothing."""
    if negatives_per_anchor(effective_batch_size, hard_negatives) < 1:
        raise ConfigError(
            "a contrastive update of one pair has no negative to tell its positive from; use an effective batch "
            "of at least 2 pairs (--effective_batch_size), or add a hard `negative` column"
        )
