"""Accumulation windows, counted before they are computed.

A recipe's loop takes one optimizer update at a time:

    for window in train_windows:
        for batch in window:
            with accelerator.accumulate(model):
                loss_sum = training_step(model, batch)
                accelerator.backward(loss_sum * window.scale)
                ...

`TrainWindows` fetches each window's micro-batches first (they are on the device already, or
soon will be), counts what the loss is a mean over (samples, target tokens, pairs, completions:
the recipe's `count_items`) in every micro-batch, and sums the count over the micro-batches and
all processes with one all-reduce: T, known before the first forward, like the Transformers
Trainer's `num_items_in_batch`. Then `window.scale` (`core.loss_normalization.window_loss_scale`)
makes the accumulated gradient exactly the gradient of Σ losses / T, the short last window of an
epoch and uneven process shares included; nothing is rescaled afterwards.

Everything that decides a window's shape lives here, not in the loop: where a resume re-enters
the epoch, the accumulation schedule (`UpdatePlan`), the short last window, the rows
Accelerate repeats so every process steps together (they run, for DDP's all-reduce, and count as
nothing: their micro-batch's scale is 0), the gradient-noise measurement (`NoiseScaleMeter`, whose
hooks need no call in the loop), and the out-of-memory retry (`--auto_micro_batch`), which splits
the window in hand into smaller micro-batches and runs it again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from accelerate.utils import DistributedType, find_batch_size

from ft_accum.core.batch_arithmetic import BatchPlan
from ft_accum.core.errors import ConfigError
from ft_accum.core.loss_normalization import check_finite_window, window_loss_scale
from ft_accum.training.memory import free_memory, is_out_of_memory


def start_window(accelerator, micro_batches: int) -> None:
    """Make Accelerate sync after exactly `micro_batches` more micro-batches (and divide by that number).

    Accelerate syncs when its micro-batch counter is a multiple of `gradient_accumulation_steps`
    (accelerate/accelerator.py, `_do_sync`; the recipes' Accelerator is built with
    `sync_with_dataloader=False`, so a window fetched ahead does not sync at the loader's end).
    Accelerate has no public way to restart the counter: `accelerator.step` is written here and
    nowhere else, and tests/test_windows.py checks on a real Accelerator that the next window syncs
    after exactly `micro_batches` micro-batches (it fails if an upgrade renames the counter).
    """
    accelerator.gradient_accumulation_steps = micro_batches
    accelerator.step = 0


def backward_divisor(accelerator, micro_batches: int) -> int:
    """N, what `accelerator.backward` divides each loss by: the window's micro-batches (`start_window`), or
    under DeepSpeed its engine's configured accumulation steps (DeepSpeed divides in its own backward)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return accelerator.deepspeed_engine_wrapped.engine.gradient_accumulation_steps()
    return micro_batches


def real_rows(dataset_rows: int, batch_index: int, num_processes: int, process_index: int, micro: int) -> int:
    """How many leading rows of this process's micro-batch `batch_index` (0-based in the epoch) are
    real rows of the dataset, not Accelerate's repeats: clamp(n − (k·P + r)·b, 0, b).

    Accelerate's sharded sampler (`BatchSamplerShard` with `even_batches=True`, its default) deals
    the epoch's batches of b rows round-robin: batch k of process r is batch k·P + r of one stream,
    and it completes the last short batch, and any missing round, with rows from the epoch's
    start, so that every process runs as many micro-batches (DDP needs every process in each
    all-reduce). Those repeats sit at the end of the stream, at positions ≥ n.
    """
    return max(0, min(micro, dataset_rows - (batch_index * num_processes + process_index) * micro))


def take_rows(batch: dict, rows: int | slice) -> dict:
    """The first `rows` rows (or the slice `rows`) of every tensor in `batch` that has one row per sample.

    A tensor whose entries are not rows (a vision-language batch's images or image patches) is named in
    `batch["row_of"]` with the row of each entry (data/vision_chat_data.py): it keeps the entries of the
    rows taken, whole images only."""
    size = find_batch_size(batch)
    if isinstance(rows, int):
        if rows >= size:
            return batch
        rows = slice(0, rows)
    row_of = batch.get("row_of", {})
    taken = {
        k: v[rows] if isinstance(v, torch.Tensor) and v.dim() and len(v) == size and k not in row_of else v
        for k, v in batch.items()
    }
    if row_of:
        start, stop, _ = rows.indices(size)
        keep = {key: (owner >= start) & (owner < stop) for key, owner in row_of.items()}
        taken |= {key: batch[key][keep[key]] for key in row_of}
        taken["row_of"] = {key: owner[keep[key]] - start for key, owner in row_of.items()}
    return taken


def split_rows(batch: dict, micro: int) -> list[dict]:
    """`batch` cut into micro-batches of at most `micro` rows, in order (the out-of-memory retry)."""
    rows = find_batch_size(batch)
    return [take_rows(batch, slice(start, start + micro)) for start in range(0, rows, micro)]


def count_tokens(batch) -> torch.Tensor | int:
    """The micro-batch's non-padding tokens, for the throughput columns: the ones of every attention mask
    it holds (a preference pair's chosen and rejected masks both count), else every input id (packed
    blocks have no padding); 0 for a batch of neither (images)."""
    if not isinstance(batch, Mapping):
        return 0
    masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
    if masks:
        return sum(mask.sum() for mask in masks)
    return batch["input_ids"].numel() if "input_ids" in batch else 0


class Window:
    """One optimizer update: this process's micro-batches, and what they count on all processes.

    Iterate over it for the micro-batches (each one makes Accelerate's window: `start_window`);
    `scale` is the current micro-batch's factor for `accelerator.backward(loss_sum * window.scale)`.
    `add_loss` keeps each summed loss for the log and for `check_finite_loss`, the guard at the
    sync step. `ends_epoch` is true for the last window of an epoch, or of the run; `evaluation_due`
    also after every --eval_steps updates (`EvaluatedWindows`): the recipe evaluates after it.
    """

    def __init__(
        self,
        accelerator,
        micro_batches: list,
        *,
        count_items: Callable[[Any], Any],
        plan: BatchPlan,
        real: list[bool] | None = None,
        update: int = 0,
        last_checkpoint: str | None = None,
        ends_epoch: bool = False,
        epoch: int = 0,
        epoch_samples: int = 0,
        epoch_size: int = 0,
        count_tokens: Callable[[Any], Any] | None = count_tokens,
    ):
        self.accelerator, self.plan, self.update, self.last_checkpoint = accelerator, plan, update, last_checkpoint
        self.ends_epoch = self.evaluation_due = ends_epoch
        # Where the epoch stands once this window is done: this process's samples of `epoch` consumed, of `epoch_size`.
        self.epoch, self.epoch_samples, self.epoch_size = epoch, epoch_samples, epoch_size
        self.lr_steps = 1  # LR-scheduler steps this update stands for (an adaptive schedule: more)
        self.noise = None  # a NoiseScaleMeter, when --measure_noise_scale
        self.on_out_of_memory = None  # the retry of --auto_micro_batch, when on: returns the smaller plan
        self.count_tokens = count_tokens  # the throughput's tokens; None: the items are tokens (a token loss)
        self._set_micro_batches(micro_batches, real or [True] * len(micro_batches), count_items)

    def _set_micro_batches(self, micro_batches: list, real: list[bool], count_items) -> None:
        """Count every micro-batch and all-reduce the sums: on the device, no host read (`summary` reads them
        once, with the loss, at the sync step)."""
        self.micro_batches, self.real, self.count_items = micro_batches, real, count_items
        counts = torch.stack(
            [self._counts(batch, count_items) * is_real for batch, is_real in zip(micro_batches, real)]
        )
        self.counts = self.accelerator.reduce(counts.sum(0).to(self.accelerator.device), reduction="sum")
        self.micro_items = counts[:, 0]  # this process's, for the noise scale
        divisor = backward_divisor(self.accelerator, len(micro_batches))
        # A float32 0-d tensor: the scale stays on the device, and does not promote an fp32 loss to fp64.
        self._scale = window_loss_scale(self.counts[0], divisor, self.accelerator.num_processes).float()
        self.losses: list[torch.Tensor] = []
        self._summary = None
        self._index = 0

    def _counts(self, batch, count_items) -> torch.Tensor:
        """[items..., samples, tokens] of one micro-batch, float64 on the device."""
        items = torch.as_tensor(count_items(batch), dtype=torch.float64, device=self.accelerator.device).reshape(-1)
        rows = float(find_batch_size(batch) or 0)
        tokens = items[:1] if self.count_tokens is None else self.count_tokens(batch)
        tokens = torch.as_tensor(tokens, dtype=torch.float64, device=items.device).reshape(1)
        return torch.cat([items, items.new_tensor([rows]), tokens])

    @property
    def num_items(self) -> torch.Tensor:
        """T: what the loss is a mean over, in the whole window on all processes (a 0-d tensor on the device)."""
        return self.counts[0]

    @property
    def extra_counts(self) -> torch.Tensor:
        """The window's totals of the further counts `count_items` returned after the first (ORPO: chosen tokens)."""
        return self.counts[1:-2]

    @property
    def epoch_progress(self) -> float:
        """The epoch, with its fraction, once this window is done (metrics.jsonl's `epoch`)."""
        return self.epoch + self.epoch_samples / self.epoch_size if self.epoch_size else float(self.epoch)

    @property
    def is_repeat(self) -> bool:
        """The current micro-batch holds only rows Accelerate repeated (it runs for DDP, and counts as nothing)."""
        return not self.real[self._index]

    @property
    def scale(self) -> torch.Tensor | float:
        """N·P/T for a micro-batch of real rows, 0 for one of Accelerate's repeats (see window_loss_scale)."""
        return self._scale if self.real[self._index] else 0.0

    def __iter__(self) -> Iterator:
        index = 0
        while index < len(self.micro_batches):
            if index == 0:
                start_window(self.accelerator, len(self.micro_batches))
                self.losses.clear()
                if self.noise is not None:
                    self.noise.start_window()
            self._index, self._restart = index, False
            yield self.micro_batches[index]
            if self._restart:  # out of memory: the same window again, in smaller micro-batches
                index = 0
                continue
            if self.noise is not None and self.real[index]:
                # The hooks saw ∇(loss_sum · scale / N): the micro-batch's mean gradient times items · scale / N.
                divisor = backward_divisor(self.accelerator, len(self.micro_batches))
                items = self.micro_items[index]
                self.noise.after_micro_batch(
                    self.accelerator, backward_scale=items * self._scale / divisor, size=items
                )
            index += 1

    def add_loss(self, loss_sum: torch.Tensor) -> None:
        """Keep the micro-batch's summed loss (detached; a repeat's as 0) for the log and `check_finite_loss`."""
        self.losses.append(
            loss_sum.detach().float() if self.real[self._index] else loss_sum.new_zeros((), dtype=torch.float32)
        )

    def summary(self) -> dict[str, Any]:
        """The window's numbers on the host, read once (one all-reduce of the losses, one host read for
        everything): its mean loss Σ summed losses / T, its items, samples and tokens on all processes,
        and this process's summed loss of each micro-batch (to name one that is not finite)."""
        if self._summary is None:
            device = self.accelerator.device
            losses = torch.stack(self.losses).to(device) if self.losses else torch.zeros(0, device=device)
            total = self.accelerator.reduce(losses.double().sum().reshape(1), reduction="sum")
            values = torch.cat([total, self.counts, losses.double()]).tolist()
            loss, counts, micro_losses = values[0], values[1 : 1 + len(self.counts)], values[1 + len(self.counts) :]
            if counts[0] <= 0:
                raise ConfigError(
                    f"update {self.update + 1} has nothing to learn from: its micro-batches count 0 items on every "
                    "process (every label masked, or empty rows); check the data's label/response columns"
                )
            self._summary = {
                "loss": loss / counts[0],
                "items": counts[0],
                "samples": counts[-2],
                "tokens": counts[-1],
                "micro_batch_losses": micro_losses,
            }
        return self._summary

    def check_finite_loss(self) -> None:
        """At the sync step, before `optimizer.step()`: stop in one line if the window's loss is NaN or
        infinite, naming the micro-batch, so the weights never take the update (not in fp16, whose
        overflows the grad scaler skips and counts)."""
        if self.accelerator.mixed_precision == "fp16":
            return
        summary = self.summary()
        check_finite_window(
            summary["loss"],
            summary["micro_batch_losses"],
            self.update + 1,
            self.accelerator.process_index,
            self.last_checkpoint,
        )

    @contextlib.contextmanager
    def retry_on_out_of_memory(self):
        """With --auto_micro_batch, an out-of-memory error in this block drops the window's partial
        gradients, splits its micro-batches into smaller ones (`BatchPlan.shrunk`: the same effective
        batch, so the same LR) and runs the window again from its first; off, it is a bare block."""
        if self.on_out_of_memory is None:
            yield
            return
        try:
            yield
        except RuntimeError as exc:  # torch.OutOfMemoryError is one; so is a CPU allocator refusal
            if not is_out_of_memory(exc):
                raise
            self.plan = self.on_out_of_memory(exc)
            pieces = [
                (piece, is_real)
                for batch, is_real in zip(self.micro_batches, self.real)
                for piece in split_rows(batch, self.plan.micro)
            ]
            self._set_micro_batches([p for p, _ in pieces], [r for _, r in pieces], self.count_items)
            self._restart = True


class EvaluatedWindows:
    """The run's windows (`TrainWindows`, or GRPO's rounds), each marked `evaluation_due`: at an epoch's
    (or the run's) end, and after every `eval_steps`-th update (--eval_steps); they end early once
    `state.stopped_early_at` is set (early stopping, training_state.RunTracker.log_evaluation), before
    the next window is fetched."""

    def __init__(self, windows, state, eval_steps: int | None):
        self.windows, self.state, self.eval_steps = windows, state, eval_steps

    @property
    def plan(self) -> BatchPlan:
        return self.windows.plan

    def __iter__(self) -> Iterator[Window]:
        windows = iter(self.windows)
        while self.state.stopped_early_at is None and (window := next(windows, None)) is not None:
            every = self.eval_steps and (window.update + 1) % self.eval_steps == 0
            window.evaluation_due = window.ends_epoch or bool(every)
            yield window


class TrainWindows:
    """The run's remaining windows, epoch after epoch, up to its last update (see the module docstring).

    `count_items(batch)` returns what the recipe's loss is a mean over in one micro-batch (a number
    or 0-d tensor; or a 1-D tensor whose first entry is that, the rest further totals the loss
    needs, `Window.extra_counts`). `update_plan` is the run's `UpdatePlan` (training/update_plan.py);
    `noise` a `NoiseScaleMeter` or None. With `tokens_are_items`
    (a loss that is a mean over tokens) the throughput's tokens are the items; else `count_tokens`'s.
    `prepare_batch(batch, update)`, when given, rewrites each micro-batch of real rows before the window
    is counted (GKD's on-policy answers: training/on_policy.py).
    """

    def __init__(
        self,
        accelerator,
        train_dataloader,
        state,
        plan: BatchPlan,
        *,
        count_items: Callable[[Any], Any],
        update_plan,
        noise=None,
        auto_micro_batch: bool = False,
        tokens_are_items: bool = False,
        prepare_batch: Callable[[Any, int], Any] | None = None,
    ):
        self.prepare_batch = prepare_batch
        self.accelerator, self.train_dataloader, self.state, self.plan = accelerator, train_dataloader, state, plan
        self.count_tokens = None if tokens_are_items else count_tokens
        self.count_items, self.update_plan, self.noise = count_items, update_plan, noise
        self.loader_micro = plan.micro  # rows per batch of the dataloader; the retry splits them, the loader stays
        self.auto_micro_batch = auto_micro_batch
        if auto_micro_batch and accelerator.num_processes > 1:
            # An OOM on one rank alone would leave the others waiting in a collective.
            raise ConfigError("--auto_micro_batch works on one process; drop it, or launch one process")

    def __iter__(self) -> Iterator[Window]:
        state = self.state
        while state.epoch < self.update_plan.num_epochs and state.scheduler_steps < self.update_plan.num_update_steps:
            yield from self._epoch()
            if state.scheduler_steps >= self.update_plan.num_update_steps:
                return
            state.next_epoch()

    def _epoch(self) -> Iterator[Window]:
        accelerator, state, loader = self.accelerator, self.state, self.train_dataloader
        loader.set_epoch(state.epoch)
        seen = state.epoch_samples // self.loader_micro  # checkpoints are taken between windows
        batches = accelerator.skip_first_batches(loader, seen) if seen else loader
        stream = iter(enumerate(batches, start=seen))
        left = len(loader) - seen
        while left > 0 and state.scheduler_steps < self.update_plan.num_update_steps:
            self.plan = self.update_plan.at_window_start(accelerator, self.plan, state, noise=self.noise)
            size = min(self.plan.accumulation * self.plan.micro // self.loader_micro, left)
            fetched = [self._real_part(index, batch) for index, batch in (next(stream) for _ in range(size))]
            if self.prepare_batch is not None:
                fetched = [(self.prepare_batch(b, state.step) if real else b, real) for b, real in fetched]
            left -= size
            window = self._window(
                fetched, ends_epoch=left == 0, epoch_samples=state.epoch_samples + size * self.loader_micro
            )
            window.lr_steps = self.update_plan.lr_steps(window)
            window.ends_epoch |= state.scheduler_steps + window.lr_steps >= self.update_plan.num_update_steps
            yield window
        if left == 0:  # one more step ends the loader's iteration, so that Accelerate ends its epoch
            for _ in stream:
                pass

    def _real_part(self, index: int, batch) -> tuple[Any, bool]:
        """(the batch without Accelerate's repeated rows, whether any real row is left); an all-repeat batch whole."""
        accelerator = self.accelerator
        dataset_rows = len(self.train_dataloader.dataset)
        real = real_rows(dataset_rows, index, accelerator.num_processes, accelerator.process_index, self.loader_micro)
        return (batch, False) if real == 0 else (take_rows(batch, real), True)

    def _window(self, fetched: list[tuple[Any, bool]], ends_epoch: bool, epoch_samples: int) -> Window:
        micro_batches, real = [], []
        for batch, is_real in fetched:
            pieces = split_rows(batch, self.plan.micro) if self.plan.micro < self.loader_micro else [batch]
            micro_batches += pieces
            real += [is_real] * len(pieces)
        window = Window(
            self.accelerator,
            micro_batches,
            count_items=self.count_items,
            plan=self.plan,
            real=real,
            update=self.state.step,
            last_checkpoint=self.state.last_checkpoint,
            ends_epoch=ends_epoch,
            epoch=self.state.epoch,
            epoch_samples=epoch_samples,
            epoch_size=self.loader_micro * len(self.train_dataloader),
            count_tokens=self.count_tokens,
        )
        window.noise = self.noise
        if self.auto_micro_batch:
            window.on_out_of_memory = self._shrink
        return window

    def _shrink(self, exc: BaseException) -> BatchPlan:
        """After an out-of-memory error: drop the partial gradients, return what the failed step held, and
        halve the micro-batch (its smallest prime factor) for this window and the rest of the run."""
        self.update_plan.optimizer.zero_grad(set_to_none=True)
        free_memory(self.accelerator.device)
        smaller = self.plan.shrunk()
        self.accelerator.print(
            f"out of memory at micro-batch {self.plan.micro}: now {smaller.describe()}, the same effective batch; "
            "retrying the update"
        )
        self.plan = smaller
        return smaller
