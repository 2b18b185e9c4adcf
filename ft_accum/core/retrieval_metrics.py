"""Retrieval quality with one relevant document per query: Recall@k, MRR@k and nDCG@k.

Query i's relevant document is document i; `positive_ranks` gives its 1-based rank r_i among all
documents by score (ties counted against it: a document scoring as high as the relevant one ranks above).
With one relevant document the ideal DCG is 1, so (Manning, Raghavan and Schütze 2008, §8.4; as
BEIR and sentence-transformers' InformationRetrievalEvaluator compute them):
    Recall@k = mean(r_i ≤ k),  MRR@k = mean(1/r_i if r_i ≤ k else 0),  nDCG@k = mean(1/log2(1 + r_i) if r_i ≤ k else 0).
"""

from __future__ import annotations

import torch


def positive_ranks(scores: torch.Tensor) -> torch.Tensor:
    """[Q] 1-based ranks of each query's relevant document (the diagonal of `scores` [Q, Q])."""
    return (scores >= scores.diagonal().unsqueeze(1)).sum(1)


def retrieval_metrics(ranks: torch.Tensor, k: int = 10) -> dict[str, float]:
    """Recall@1, MRR@k and nDCG@k of the ranks (see the module docstring)."""
    ranks = ranks.double()
    within = ranks <= k
    return {
        "recall@1": float((ranks == 1).double().mean()),
        f"mrr@{k}": float(torch.where(within, 1 / ranks, 0.0).mean()),
        f"ndcg@{k}": float(torch.where(within, 1 / torch.log2(1 + ranks), 0.0).mean()),
    }
