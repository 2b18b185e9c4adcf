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
   share of the update's (with the micro-batch's anchors' summed loss, for the log). The recipe
   backpropagates it times `window.scale` (÷ the update's anchors, with Accelerate's ÷N and DDP's ÷P
   undone), under `accelerator.accumulate(model)`.

The peak holds one micro-batch's activations plus the update's embeddings and score matrix. A window
of one micro-batch per process skips the cache: one forward with a graph, as without accumulation.
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
    (anchors, positives) or (anchors, positives, negatives). `losses(*columns)` returns one loss per
    anchor over the update's columns, every process's (core/contrastive_loss.contrastive_losses).

    A window of one micro-batch on each process needs no cache: its `replay` embeds with a graph and
    returns the update's loss itself, whose gradient reaches the weights through this process's rows
    (the other processes' rows are gathered without a graph), so no second forward runs.
    """

    def __init__(self, accelerator, embed: Callable[[dict], Sequence[torch.Tensor]], losses: Callable):
        self.accelerator, self.embed, self.losses = accelerator, embed, losses
        self.device = accelerator.device if accelerator is not None else torch.device("cpu")

    def first_pass(self, micro_batches: Sequence[dict], real: Sequence[bool] | None = None) -> None:
        """Embed every micro-batch without a graph, compute the update's loss over all processes and cache
        its gradient with respect to every embedding (nothing to do for a window of one micro-batch)."""
        real = list(real) if real is not None else [True] * len(micro_batches)
        self.real = dict(zip(map(id, micro_batches), real))
        self.states, self.gradients, self.micro_losses = {}, {}, {}
        if len(micro_batches) == 1:
            return
        embedded = []
        for batch, is_real in zip(micro_batches, real):
            self.states[id(batch)] = RandomState(self.device)
            with torch.no_grad():
                columns = tuple(e.detach() for e in self.embed(batch))
            embedded.append((batch, columns if is_real else tuple(e[:0] for e in columns)))
        local = [torch.cat([columns[c] for _, columns in embedded]) for c in range(len(embedded[0][1]))]
        leaves = [column.float().requires_grad_() for column in self._gathered(local)[0]]
        per_anchor = self.losses(*leaves)
        gradients = torch.autograd.grad(per_anchor.sum(), leaves)
        start = self.offset
        for batch, columns in embedded:
            rows = slice(start, start + len(columns[0]))
            self.gradients[id(batch)] = tuple(g[rows] for g in gradients)
            self.micro_losses[id(batch)] = per_anchor[rows].detach().sum()
            start = rows.stop

    def replay(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's anchors' summed loss, detached; the surrogate to backpropagate). The surrogate is
        the micro-batch embedded again with a graph and its first pass's dropout masks, as Σ embedding ·
        cached gradient: backpropagating it adds the micro-batch's share of ∇(the update's summed loss)."""
        if id(batch) not in self.gradients:
            return self._one_pass(batch)
        gradients = self.gradients[id(batch)]
        with self.states[id(batch)].replay():
            columns = self.embed(batch)
        if len(gradients[0]) == 0:  # rows Accelerate repeated: the forward runs (DDP joins it), counts nothing
            return self.micro_losses[id(batch)], sum(column.sum() * 0 for column in columns)
        surrogate = sum((column.float() * gradient).sum() for column, gradient in zip(columns, gradients))
        return self.micro_losses[id(batch)], surrogate

    def _one_pass(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's only micro-batch: embedded once, with a graph, and the update's loss returned."""
        columns = self.embed(batch)
        local = [column if self.real[id(batch)] else column[:0] for column in columns]
        gathered, with_graph = self._gathered(local)
        per_anchor = self.losses(*with_graph)
        rows = slice(self.offset, self.offset + len(local[0]))
        # A repeat's columns join the graph at weight 0: DDP waits for a gradient of every parameter.
        keep_in_graph = sum(column.sum() * 0 for column in columns)
        return per_anchor[rows].detach().sum(), per_anchor.sum() + keep_in_graph

    def _gathered(self, local: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(every process's rows of each column, detached; the same with this process's rows kept in the
        graph), and `self.offset`, where this process's rows start."""
        gathered = [gather_rows(self.accelerator, column.detach()) for column in local]
        gathered, self.offset = [rows for rows, _ in gathered], gathered[0][1]
        rows = slice(self.offset, self.offset + len(local[0]))
        with_graph = [
            torch.cat([g[: rows.start], column.float(), g[rows.stop :]]) for g, column in zip(gathered, local)
        ]
        return [g.float() for g in gathered], with_graph
