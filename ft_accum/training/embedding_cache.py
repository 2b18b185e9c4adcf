"""GradCache: a contrastive update over all its pairs, exact, at one micro-batch's activation memory.

Gao, Zhang, Han and Callan 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited
Setup" (arXiv:2101.06983); sentence-transformers' `CachedMultipleNegativesRankingLoss` does the same.
An in-batch-negatives loss couples every pair of the update (core/contrastive_loss.py), so ordinary
accumulation, a loss per micro-batch, is not the update's loss at all. In three steps:

1. `first_pass`: embed every micro-batch of the window without a graph, keeping the RNG state each
   forward started from (so its dropout masks can be drawn again);
2. gather every process's embeddings, compute the update's loss over all of them (every process
   computes the same one), and its gradient with respect to each embedding: the cache;
3. `replay(batch)`: embed the micro-batch again, with a graph and the same RNG state, and return
   Σ embedding · cached gradient, whose gradient with respect to the weights is that micro-batch's
   share of the update's. The recipe backpropagates it times `window.scale` (÷ the update's anchors,
   with Accelerate's ÷N and DDP's ÷P undone), under `accelerator.accumulate(model)`.

The peak holds one micro-batch's activations plus the update's embeddings and score matrix.
Micro-batches made only of the rows Accelerate repeats (training/windows.py) take no part in the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch


class RandomState:
    """The RNG states a forward draws its dropout masks from: the CPU's, and the CUDA device's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def replay(self):
        """Draw from the saved states inside the block; the stream outside it is left as it was."""
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def gather_rows(accelerator, local: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(every process's rows of `local` [n_p, d] in process order, the offset of this process's rows).
    Processes may hold different numbers of rows (a short last batch): padded to gather, then cut."""
    if accelerator is None or accelerator.num_processes == 1:
        return local, 0
    counts = accelerator.gather(torch.tensor([len(local)], device=local.device)).tolist()
    padded = accelerator.gather(accelerator.pad_across_processes(local, dim=0))
    width = max(counts)
    rows = torch.cat([padded[p * width : p * width + n] for p, n in enumerate(counts)])
    return rows, sum(counts[: accelerator.process_index])


class EmbeddingCache:
    """One window's embeddings and their cached gradients (see the module docstring).

    `embed(batch)` returns the micro-batch's embeddings as a tuple of columns, [rows, d] each:
    (anchors, positives) or (anchors, positives, negatives). `loss_sum(*columns)` is the update's summed
    loss over all of its anchors, every process's (core/contrastive_loss.contrastive_loss_sum).
    """

    def __init__(self, accelerator, embed: Callable[[dict], Sequence[torch.Tensor]], loss_sum: Callable):
        self.accelerator, self.embed, self.loss_sum = accelerator, embed, loss_sum
        self.device = accelerator.device if accelerator is not None else torch.device("cpu")

    def first_pass(self, micro_batches: Sequence[dict], real: Sequence[bool] | None = None) -> torch.Tensor:
        """Embed every micro-batch without a graph, compute the update's loss over all processes and cache
        its gradient with respect to every embedding; returns the summed loss (a 0-d tensor, no host read)."""
        real = list(real) if real is not None else [True] * len(micro_batches)
        self.states, self.gradients = {}, {}
        embedded = []
        for batch, is_real in zip(micro_batches, real):
            self.states[id(batch)] = RandomState(self.device)
            with torch.no_grad():
                columns = tuple(e.detach() for e in self.embed(batch))
            embedded.append((batch, columns if is_real else tuple(e[:0] for e in columns)))
        local = [torch.cat([columns[c] for _, columns in embedded]) for c in range(len(embedded[0][1]))]
        gathered, offset = zip(*(gather_rows(self.accelerator, column) for column in local))
        leaves = [column.detach().float().requires_grad_() for column in gathered]
        loss = self.loss_sum(*leaves)
        gradients = torch.autograd.grad(loss, leaves)
        start = offset[0]
        for batch, columns in embedded:
            rows = len(columns[0])
            self.gradients[id(batch)] = tuple(g[start : start + rows] for g in gradients)
            start += rows
        return loss.detach()

    def replay(self, batch: dict) -> torch.Tensor:
        """The micro-batch embedded again with a graph and its first pass's dropout masks, as the surrogate
        Σ embedding · cached gradient: backpropagating it adds the micro-batch's share of ∇(summed loss)."""
        gradients = self.gradients[id(batch)]
        with self.states[id(batch)].replay():
            columns = self.embed(batch)
        if len(gradients[0]) == 0:  # rows Accelerate repeated: the forward runs (DDP joins it), counts nothing
            return sum(column.sum() * 0 for column in columns)
        return sum((column.float() * gradient).sum() for column, gradient in zip(columns, gradients))
