"""GradCache (training/embedding_cache.py) against the update's real contrastive loss, on a tiny BERT
bi-encoder (mean pooling, normalised), pairs of unequal lengths, and the losses of core/contrastive_loss.py.

- Dropout off: the cached two-pass gradient equals one backward of the loss over all pairs embedded in
  one forward (the literal full batch), at (32 × 1), (8 × 4) and a short last window (8, 8, 8, 4).
- Dropout on: no single forward draws the micro-batches' masks, so the reference embeds each
  micro-batch with a graph, in the same order from the same seed, and backpropagates the loss over all
  of them once. The replay must draw the same masks: without the saved RNG state it fails.
- Teeth: the loss of each micro-batch alone (ordinary accumulation) is far from the update's.
"""

import pytest
import torch
from transformers import BertConfig, BertModel

from ft_accum.core.contrastive_loss import contrastive_loss_sum
from ft_accum.training import embedding_cache
from ft_accum.training.embedding_cache import EmbeddingCache

VOCAB, DIM = 50, 32


def bi_encoder(dropout: float) -> BertModel:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, max_position_embeddings=32,
    )  # fmt: skip
    return BertModel(config).train()


def encode(model, ids, mask):
    """Mean pooling over the real tokens, then unit length: all-MiniLM-L6-v2's embedding."""
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(pooled, dim=-1)


def texts(n: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n texts of 3–12 tokens, padded to the longest."""
    lengths = torch.randint(3, 13, (n,), generator=generator)
    ids = torch.randint(1, VOCAB, (n, int(lengths.max())), generator=generator)
    mask = (torch.arange(ids.shape[1]) < lengths.unsqueeze(1)).long()
    return ids * mask, mask


def make_pairs(n: int, negatives: bool) -> dict:
    generator = torch.Generator().manual_seed(1)
    columns = ("anchor", "positive", "negative") if negatives else ("anchor", "positive")
    pairs = {}
    for column in columns:
        pairs[f"{column}_ids"], pairs[f"{column}_mask"] = texts(n, generator)
    return pairs


def split(pairs: dict, sizes: list[int]) -> list[dict]:
    batches, start = [], 0
    for size in sizes:
        batches.append({k: v[start : start + size] for k, v in pairs.items()})
        start += size
    return batches


def embed_with(model):
    def embed(batch):
        columns = [c for c in ("anchor", "positive", "negative") if f"{c}_ids" in batch]
        return tuple(encode(model, batch[f"{c}_ids"], batch[f"{c}_mask"]) for c in columns)

    return embed


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


def cached_gradient(model, batches, loss_sum, seed=3):
    """GradCache: the first pass, then each micro-batch replayed and backpropagated ÷ the update's anchors."""
    model.zero_grad()
    torch.manual_seed(seed)
    cache = EmbeddingCache(None, embed_with(model), loss_sum)
    cache.first_pass(batches)
    anchors = sum(len(b["anchor_ids"]) for b in batches)
    for batch in batches:
        (cache.replay(batch) / anchors).backward()
    return flat_grad(model)


def reference_gradient(model, batches, loss_sum, seed=3):
    """The update's loss over every pair, each micro-batch embedded with a graph (its own dropout masks,
    drawn in the same order as GradCache's first pass), one backward."""
    model.zero_grad()
    torch.manual_seed(seed)
    embed = embed_with(model)
    columns = list(zip(*(embed(b) for b in batches)))
    anchors = sum(len(b["anchor_ids"]) for b in batches)
    (loss_sum(*(torch.cat(c) for c in columns)) / anchors).backward()
    return flat_grad(model)


def naive_gradient(model, batches, loss_sum):
    """Ordinary accumulation: each micro-batch's own in-batch loss, its mean ÷ the micro-batches."""
    model.zero_grad()
    embed = embed_with(model)
    for batch in batches:
        (loss_sum(*embed(batch)) / len(batch["anchor_ids"]) / len(batches)).backward()
    return flat_grad(model)


LOSSES = {
    "info_nce": lambda *c: contrastive_loss_sum(*c, scale=20.0),
    "symmetric": lambda *c: contrastive_loss_sum(*c, scale=20.0, symmetric=True),
}
SPLITS = {"32x1": [32], "8x4": [8] * 4, "short_last_window": [8, 8, 8, 4]}


@pytest.mark.parametrize("negatives", [False, True], ids=["pairs", "hard_negatives"])
@pytest.mark.parametrize("loss", LOSSES, ids=list(LOSSES))
@pytest.mark.parametrize("sizes", SPLITS.values(), ids=list(SPLITS))
def test_without_dropout_the_cache_equals_one_forward_of_the_whole_update(sizes, loss, negatives):
    model = bi_encoder(dropout=0.0)
    pairs = make_pairs(sum(sizes), negatives)
    full = reference_gradient(model, [pairs], LOSSES[loss])
    ours = cached_gradient(model, split(pairs, sizes), LOSSES[loss])
    # fp32, the same sums in another order (padding to each micro-batch's own length changes nothing).
    assert relative_error(ours, full) <= 1e-5


@pytest.mark.parametrize("negatives", [False, True], ids=["pairs", "hard_negatives"])
@pytest.mark.parametrize("sizes", [SPLITS["8x4"], SPLITS["short_last_window"]], ids=["8x4", "short_last_window"])
def test_with_dropout_the_replay_draws_the_same_masks(sizes, negatives, monkeypatch):
    model = bi_encoder(dropout=0.1)
    batches = split(make_pairs(sum(sizes), negatives), sizes)
    reference = reference_gradient(model, batches, LOSSES["info_nce"])
    assert relative_error(cached_gradient(model, batches, LOSSES["info_nce"]), reference) <= 1e-5
    # Teeth: ordinary accumulation is not the update's loss (measured ~0.5 of the gradient here) ...
    assert relative_error(naive_gradient(model, batches, LOSSES["info_nce"]), reference) > 0.1
    # ... and a replay that does not restore the RNG state draws other masks.
    monkeypatch.setattr(embedding_cache.RandomState, "replay", lambda self: torch.random.fork_rng(devices=[]))
    assert relative_error(cached_gradient(model, batches, LOSSES["info_nce"]), reference) > 1e-3


def test_rows_accelerate_repeated_take_no_part():
    """A micro-batch of repeats (training/windows.py: real=False) runs, but adds no anchor, no negative and no gradient."""
    model = bi_encoder(dropout=0.0)
    pairs = make_pairs(12, negatives=False)
    batches = split(pairs, [8, 4])
    full = reference_gradient(model, batches, LOSSES["info_nce"])
    model.zero_grad()
    cache = EmbeddingCache(None, embed_with(model), LOSSES["info_nce"])
    repeat = split(pairs, [4])[0] | {}  # the same rows again, as Accelerate repeats them
    cache.first_pass([*batches, repeat], real=[True, True, False])
    for batch in [*batches, repeat]:
        (cache.replay(batch) / 12).backward()
    assert relative_error(flat_grad(model), full) <= 1e-5


def test_one_pair_without_a_negative_is_one_line():
    from ft_accum.core.errors import ConfigError

    with pytest.raises(ConfigError, match="no negative"):
        contrastive_loss_sum(torch.ones(1, 4), torch.ones(1, 4))
