"""Exact loss normalisation over an accumulation window.

The update we want is the gradient of the mean loss over every item (sample, or target token)
in the window, summed over all processes:

    g* = Σ_p Σ_i ∇S_{p,i} / T

where S_{p,i} is the *summed* loss of micro-batch i on process p and T the number of items in
the whole window on all processes. What actually lands in `.grad` when each micro-batch
backpropagates S / c (c: a fixed nominal item count, e.g. the micro-batch size) is

    g  = (1/P) Σ_p Σ_i ∇S_{p,i} / (c · N)

because `accelerator.backward` always divides by N = gradient_accumulation_steps
(accelerate/accelerator.py, Accelerator.backward), even on the incomplete last window of an
epoch, and DDP/FSDP average the gradient over the P processes. Hence

    g* = g × c · N · P / T

which is 1 for every full window of a fixed-size task, and corrects the incomplete last window
that Accelerate and Lightning divide by N anyway (Lightning-AI/pytorch-lightning#19987; fixed in
transformers#39659). T is only known at the sync step, so the correction multiplies the
accumulated gradient once, before clipping: no prefetching of batches is needed.

DeepSpeed steps inside `accelerator.backward`, so there is no point between the last backward
and the step at which to rescale; under DeepSpeed only full windows are exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ft_accum.core.errors import ConfigError


def window_gradient_scale(
    window_items: float, nominal_items: float, gradient_accumulation_steps: int, num_processes: int
) -> float:
    """c · N · P / T: the factor that turns the accumulated gradient into the window mean.

    Args:
        window_items: T, items in the window summed over all processes.
        nominal_items: c, the constant each micro-batch's summed loss was divided by.
        gradient_accumulation_steps: N, what `accelerator.backward` divided by.
        num_processes: P, what DDP averaged over.
    """
    if window_items <= 0:
        raise ValueError(f"an accumulation window must hold at least one item, got {window_items}")
    return nominal_items * gradient_accumulation_steps * num_processes / window_items


@torch.no_grad()
def scale_gradients_(parameters: Iterable[torch.nn.Parameter], factor: float) -> None:
    """Multiply every existing `.grad` by `factor` in place (a no-op when factor is exactly 1)."""
    if factor == 1.0:
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def causal_lm_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and the number of target tokens, counted **after** the causal shift.

    Position t predicts token t+1, so the targets are `labels[:, 1:]`: a row of L labels has at
    most L − 1 targets. Counting `labels != -100` before the shift adds one phantom token per row,
    which is the 2.3e-2 relative gradient error of Accelerate's
    `gradient_accumulation_for_autoregressive_models.py` and of the Trainer for models without a
    `loss_type` (measured in issue 3). Computed from the logits, so it is the same for every causal
    LM, whether or not its forward accepts `num_items_in_batch`; fp32 for a stable log-softmax.
    """
    # Shift the labels left (padding the end with ignore_index) instead of slicing the logits: a
    # slice of the (batch × length × vocab) logits would be copied, and its gradient allocated at
    # full size again in backward. transformers' ForCausalLMLoss does the same.
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    loss_sum = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return loss_sum, (shift_labels != ignore_index).sum()


def check_finite_window(
    window_loss: float, micro_batch_losses: list[float], update: int, process_index: int, last_checkpoint: str | None
) -> None:
    """Stop before the optimizer step when the window's loss is NaN or infinite (bf16, fp32).

    Called at the sync step, before clipping and `optimizer.step()`, so the weights never take the
    bad update and nothing non-finite is ever checkpointed. `micro_batch_losses` are this process's
    summed losses in window order, so the message can name the micro-batch (1-based).
    """
    if math.isfinite(window_loss):
        return
    bad = [i + 1 for i, value in enumerate(micro_batch_losses) if not math.isfinite(value)]
    where = (
        f"micro-batch {bad[0]} of {len(micro_batch_losses)} on process {process_index}"
        if bad
        else f"a micro-batch of another process (process {process_index}'s {len(micro_batch_losses)} were finite)"
    )
    raise ConfigError(
        f"the training loss became {window_loss} at update {update}, {where}; the weights were not updated and "
        f"nothing was saved after {last_checkpoint or 'the start (no checkpoint yet)'}. "
        "Lower --learning_rate, keep --max_grad_norm > 0, or check that micro-batch's data; then resume with --resume_from_checkpoint latest"
    )


def check_skipped_updates(consecutive_skipped: int, limit: int, update: int, last_checkpoint: str | None) -> None:
    """fp16 only: stop after `limit` updates in a row that the grad scaler skipped.

    A skipped update (an inf/NaN gradient, so the scaler halves its scale and drops the step) is
    routine in fp16 while the scale settles, and a few are logged and counted. Many in a row mean
    the loss itself overflows at every scale: the run is burning GPU hours without learning.
    """
    if limit and consecutive_skipped >= limit:
        raise ConfigError(
            f"the fp16 grad scaler skipped {consecutive_skipped} updates in a row (up to update {update}): the gradients "
            f"overflow at every loss scale; last good checkpoint: {last_checkpoint or 'none'}. Use bf16 (accelerate_configs/single_gpu_bf16.yaml), "
            "lower --learning_rate, or raise --max_consecutive_skipped_updates"
        )


@dataclass(frozen=True)
class WindowTotals:
    """One window's sums over all processes, read once at its sync step."""

    loss: float  # the window-mean loss: summed loss / items
    items: float  # what the loss is a mean over: samples, or target tokens
    samples: float
    tokens: float
    grad_norm: float  # before clipping
    micro_batches: int  # this process's


class AccumulationWindow:
    """This process's sums over one accumulation window, and the sync step that turns the
    accumulated gradient into the exact window mean.

    Each micro-batch backpropagates its *summed* loss over a constant (`nominal_items`); `finish`
    learns the window's true item count T from all processes at once (one all-reduce, one host
    sync per update) and rescales by c·N·P/T (`window_gradient_scale`) before clipping.
    """

    def __init__(self, device, max_grad_norm: float | None = None):
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, items, samples, tokens
        self.micro_losses: list[torch.Tensor] = []  # to name the micro-batch if the loss turns non-finite
        self.max_grad_norm = max_grad_norm  # clipped to at finish(); None or 0: not clipped

    @property
    def is_empty(self) -> bool:
        """True before the window's first micro-batch: where a schedule may change its size."""
        return not self.micro_losses

    def add(self, *, loss_sum: torch.Tensor, items, samples, tokens=0) -> None:
        """Add one micro-batch: its summed loss, the items it is a sum over (samples or target tokens),
        its samples and its tokens (ints or 0-d tensors; no host sync)."""
        self.sums[0] += loss_sum.detach()
        self.sums[1] += items
        self.sums[2] += samples
        self.sums[3] += tokens
        self.micro_losses.append(loss_sum.detach())

    def finish(self, accelerator, model, *, plan, nominal: float, state) -> WindowTotals:
        """At the sync step, before `optimizer.step()`: stop on a non-finite loss (not in fp16, whose
        overflow the grad scaler skips), rescale to the window mean, clip. Empties the window.
        `nominal`: the constant each micro-batch's summed loss was divided by before backward (c in
        c·N·P/T). `state` (a TrainingState) names the update and the last checkpoint in the error."""
        loss_total, items, samples, tokens = accelerator.reduce(self.sums, reduction="sum").tolist()
        if accelerator.mixed_precision != "fp16":
            check_finite_window(
                loss_total,
                torch.stack(self.micro_losses).tolist(),
                state.step + 1,
                accelerator.process_index,
                state.last_checkpoint,
            )
        scale_gradients_(model.parameters(), window_gradient_scale(items, nominal, plan.accumulation, plan.processes))
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), self.max_grad_norm or float("inf"))
        totals = WindowTotals(loss_total / items, items, samples, tokens, float(grad_norm), len(self.micro_losses))
        self.sums.zero_()
        self.micro_losses.clear()
        return totals
