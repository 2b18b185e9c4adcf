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

from ft_accum.core.contrastive_loss import contrastive_losses
from ft_accum.models.sentence_embedding import sentence_embeddings
from ft_accum.testing.generated_data import make_token_pairs
from ft_accum.testing.tiny_models import tiny_bi_encoder
from ft_accum.training import embedding_cache
from ft_accum.training.embedding_cache import EmbeddingCache


def split(pairs: dict, sizes: list[int]) -> list[dict]:
    batches, start = [], 0
    for size in sizes:
        batches.append({k: v[start : start + size] for k, v in pairs.items()})
        start += size
    return batches


def embed_with(model):
    def embed(batch):
        columns = [c for c in ("anchor", "positive", "negative") if f"{c}_input_ids" in batch]
        return tuple(
            sentence_embeddings(model, batch[f"{c}_input_ids"], batch[f"{c}_attention_mask"]) for c in columns
        )

    return embed


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


def cached_gradient(model, batches, losses, seed=3, real=None):
    """GradCache: the first pass, then each micro-batch replayed and backpropagated ÷ the update's anchors.
    Returns (the gradient, the logged summed loss of each micro-batch)."""
    model.zero_grad()
    torch.manual_seed(seed)
    cache = EmbeddingCache(None, embed_with(model), losses)
    cache.first_pass(batches, real)
    anchors = sum(len(b["anchor_input_ids"]) for b, r in zip(batches, real or [True] * len(batches)) if r)
    logged = []
    for batch in batches:
        loss_sum, surrogate = cache.replay(batch)
        (surrogate / max(anchors, 1)).backward()  # a window of repeats only: window.scale is 0 there
        logged.append(float(loss_sum))
    return flat_grad(model), logged


def reference_gradient(model, batches, losses, seed=3):
    """The update's loss over every pair, each micro-batch embedded with a graph (its own dropout masks,
    drawn in the same order as GradCache's first pass), one backward. Returns (gradient, summed loss)."""
    model.zero_grad()
    torch.manual_seed(seed)
    embed = embed_with(model)
    columns = list(zip(*(embed(b) for b in batches)))
    anchors = sum(len(b["anchor_input_ids"]) for b in batches)
    loss_sum = losses(*(torch.cat(c) for c in columns)).sum()
    (loss_sum / anchors).backward()
    return flat_grad(model), float(loss_sum.detach())


def naive_gradient(model, batches, losses):
    """Ordinary accumulation: each micro-batch's own in-batch loss, its mean ÷ the micro-batches."""
    model.zero_grad()
    embed = embed_with(model)
    for batch in batches:
        (losses(*embed(batch)).mean() / len(batches)).backward()
    return flat_grad(model)


LOSSES = {
    "info_nce": lambda *c: contrastive_losses(*c, scale=20.0),
    "symmetric": lambda *c: contrastive_losses(*c, scale=20.0, symmetric=True),
}
# 32 × 1 takes the one-pass path (no cache, no second forward); the others the two passes.
SPLITS = {"32x1": [32], "8x4": [8] * 4, "short_last_window": [8, 8, 8, 4]}


@pytest.mark.parametrize("negatives", [False, True], ids=["pairs", "hard_negatives"])
@pytest.mark.parametrize("loss", LOSSES, ids=list(LOSSES))
@pytest.mark.parametrize("sizes", SPLITS.values(), ids=list(SPLITS))
def test_without_dropout_the_cache_equals_one_forward_of_the_whole_update(sizes, loss, negatives):
    model = tiny_bi_encoder(dropout=0.0)
    pairs = make_token_pairs(sum(sizes), negatives)
    full, full_loss = reference_gradient(model, [pairs], LOSSES[loss])
    ours, logged = cached_gradient(model, split(pairs, sizes), LOSSES[loss])
    # fp32, the same sums in another order (padding to each micro-batch's own length changes nothing).
    assert relative_error(ours, full) <= 1e-5
    # The micro-batches' logged losses are each anchor's once: their sum is the update's loss.
    assert sum(logged) == pytest.approx(full_loss, rel=1e-5)


@pytest.mark.parametrize("negatives", [False, True], ids=["pairs", "hard_negatives"])
@pytest.mark.parametrize("sizes", [SPLITS["8x4"], SPLITS["short_last_window"]], ids=["8x4", "short_last_window"])
def test_with_dropout_the_replay_draws_the_same_masks(sizes, negatives, monkeypatch):
    model = tiny_bi_encoder(dropout=0.1)
    batches = split(make_token_pairs(sum(sizes), negatives), sizes)
    reference, _ = reference_gradient(model, batches, LOSSES["info_nce"])
    assert relative_error(cached_gradient(model, batches, LOSSES["info_nce"])[0], reference) <= 1e-5
    # Teeth: ordinary accumulation is not the update's loss (measured ~0.5 of the gradient here) ...
    assert relative_error(naive_gradient(model, batches, LOSSES["info_nce"]), reference) > 0.1
    # ... and a replay that does not restore the RNG state draws other masks.
    monkeypatch.setattr(embedding_cache.RandomState, "replay", lambda self: torch.random.fork_rng(devices=[]))
    assert relative_error(cached_gradient(model, batches, LOSSES["info_nce"])[0], reference) > 1e-3


@pytest.mark.parametrize("sizes", [[8, 4], [12]], ids=["two_passes", "one_pass"])
def test_rows_accelerate_repeated_take_no_part(sizes):
    """A micro-batch of repeats (training/windows.py: real=False) runs, but adds no anchor, no negative,
    no gradient and no loss; in a window of one micro-batch too (a process whose share is all repeats)."""
    model = tiny_bi_encoder(dropout=0.0)
    pairs = make_token_pairs(12, negatives=False)
    full, full_loss = reference_gradient(model, [pairs], LOSSES["info_nce"])
    repeat = split(pairs, [4])[0] | {}  # the same rows again, as Accelerate repeats them
    batches = [*split(pairs, sizes), repeat] if len(sizes) > 1 else [repeat]
    real = [True] * len(sizes) + [False] if len(sizes) > 1 else [False]
    ours, logged = cached_gradient(model, batches, LOSSES["info_nce"], real=real)
    if len(sizes) > 1:
        assert relative_error(ours, full) <= 1e-5 and sum(logged) == pytest.approx(full_loss, rel=1e-5)
    else:  # nothing real on this process: no gradient and no loss, but the forward ran (DDP's parameters)
        assert float(ours.abs().max()) == 0 and logged == [0.0]


def test_one_pair_without_a_negative_and_a_scale_of_zero_are_one_line_each():
    from ft_accum.core.contrastive_loss import check_negatives, check_scale, negatives_per_anchor
    from ft_accum.core.errors import ConfigError

    with pytest.raises(ConfigError, match="no negative"):
        check_negatives(1, hard_negatives=False)
    check_negatives(1, hard_negatives=True)
    assert negatives_per_anchor(64, hard_negatives=False) == 63 and negatives_per_anchor(64, True) == 127
    with pytest.raises(ConfigError, match="--scale must be > 0"):
        check_scale(0.0)
    check_scale(20.0)


DDP_SCRIPT = """
import json, sys
import torch
import torch.distributed.nn.functional as dist_nn
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from ft_accum.core.batch_arithmetic import BatchPlan
from ft_accum.core.contrastive_loss import contrastive_losses
from ft_accum.testing.generated_data import make_token_pairs
from ft_accum.models.sentence_embedding import sentence_embeddings
from ft_accum.testing.tiny_models import tiny_bi_encoder
from ft_accum.training.embedding_cache import EmbeddingCache
from ft_accum.training.windows import Window

cases, out = json.loads(sys.argv[1]), sys.argv[2]
plugin = GradientAccumulationPlugin(num_steps=1, sync_with_dataloader=False)  # as run_setup.build_accelerator
accelerator = Accelerator(gradient_accumulation_plugin=plugin)
assert accelerator.num_processes == 2, accelerator.num_processes
losses = lambda *columns: contrastive_losses(*columns, scale=20.0)

def embed_with(model):
    columns = ("anchor", "positive", "negative")
    return lambda b: tuple(sentence_embeddings(model, b[f"{c}_input_ids"], b[f"{c}_attention_mask"]) for c in columns)

results = {}
for name, (shares, dropout) in cases.items():  # one update each, on a fresh model: every share's micro-batches
    pairs_in_update = sum(map(sum, shares))
    pairs = make_token_pairs(pairs_in_update, negatives=True)
    start = sum(sum(share) for share in shares[: accelerator.process_index])
    batches = []
    for size in shares[accelerator.process_index]:  # this process's micro-batches, each padded to its own rows
        batches.append({k: v[start : start + size] for k, v in pairs.items()})
        start += size
    reference = tiny_bi_encoder(dropout=dropout)
    if not dropout:  # the reference: every pair in one forward, one backward of the mean loss
        full_loss = losses(*embed_with(reference)(pairs)).sum() / pairs_in_update
        full_loss.backward()
        expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    else:
        # Dropout on: each process embeds its micro-batches with a graph, in order, from its own seed (the masks
        # GradCache's first pass draws), gathered with autograd; every process computes the update's loss, so
        # the gathers' backward sums P copies of each gradient: Σ over processes ÷ P is the update's gradient.
        torch.manual_seed(100 + accelerator.process_index)
        local = [torch.cat(c) for c in zip(*(embed_with(reference)(b) for b in batches))]
        gathered = [torch.cat(dist_nn.all_gather(column)) for column in local]
        full_loss = losses(*gathered).sum() / pairs_in_update
        full_loss.backward()
        expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
        torch.distributed.all_reduce(expected)
        expected /= accelerator.num_processes

    model = accelerator.prepare(tiny_bi_encoder(dropout=dropout))
    plan = BatchPlan(8, len(batches), 2)
    window = Window(accelerator, batches, count_items=lambda b: len(b["anchor_input_ids"]), plan=plan)
    cache = EmbeddingCache(accelerator, embed_with(model), losses)
    torch.manual_seed(100 + accelerator.process_index)
    cache.first_pass(window.micro_batches, window.real)
    for batch in window:
        with accelerator.accumulate(model):
            loss_sum, surrogate = cache.replay(batch)
            accelerator.backward(surrogate * window.scale)
            window.add_loss(loss_sum)
    ours = torch.cat([p.grad.flatten() for p in model.parameters()])
    error = float((ours - expected).norm() / expected.norm())
    results[name] = {"relative_error": error, "loss": window.summary()["loss"], "full_loss": float(full_loss)}
if accelerator.is_main_process:
    json.dump(results, open(out, "w"))
# Leave the group together, as RunTracker.finish does: a rank that exits while the other still holds gloo's
# connections can abort it at exit ("terminate called without an active exception"), failing the launch.
accelerator.wait_for_everyone()
accelerator.end_training()
"""

# Each process's micro-batches in one update, and the dropout: even, uneven (the short last window), one
# micro-batch each (the one-pass path: no cache, the other process's rows gathered without a graph), and
# 2 × (8 × 2) with dropout on (each process replays its own masks).
SHARES = {
    "2x(8x2)": ([[8, 8], [8, 8]], 0.0),
    "uneven: (8+8) and (8+4)": ([[8, 8], [8, 4]], 0.0),
    "one pass: 8 and 5": ([[8], [5]], 0.0),
    "dropout 0.1: 2x(8x2)": ([[8, 8], [8, 8]], 0.1),
}


@pytest.mark.launch
def test_two_ddp_processes_see_every_pair_of_the_update(tmp_path):
    """Each process embeds its own micro-batches; the update's loss is computed over every process's
    pairs (gathered, padded where the shares differ) and DDP averages the replayed gradients: the same
    as one forward of all of them, with hard negatives; with dropout on, the same as each process embedding
    its micro-batches with a graph and the loss over all of them backpropagated once. The four cases run
    in one launch."""
    import json

    from conftest import launch

    script, out = tmp_path / "ddp_cache.py", tmp_path / "result.json"
    script.write_text(DDP_SCRIPT)
    launch("", [], num_processes=2, script=[str(script), json.dumps(SHARES), str(out)])
    results = json.loads(out.read_text())
    assert set(results) == set(SHARES)
    for name, result in results.items():
        # fp32 sums in another order, across two processes; the logged loss counts each anchor once.
        assert result["relative_error"] <= 1e-5, (name, result)
        assert result["loss"] == pytest.approx(result["full_loss"], rel=1e-5), (name, result)
