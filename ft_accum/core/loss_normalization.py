"""Exact loss normalisation over an accumulation window.

The update we want is the gradient of the mean loss over every item (sample, or target token)
in the window, summed over all processes:

    g* = Σ_p Σ_i ∇S_{p,i} / T

where S_{p,i} is the *summed* loss of micro-batch i on process p and T the number of items in
the whole window on all processes. `accelerator.backward` divides every loss by N (the
gradient_accumulation_steps it was given; accelerate/accelerator.py, Accelerator.backward) and
DDP/FSDP average the gradient over the P processes, so backpropagating S_{p,i} · s with

    s = N · P / T                                              (window_loss_scale)

leaves exactly g* in `.grad`. T is counted before the window's first forward (the Transformers
Trainer's `num_items_in_batch`; training/windows.py fetches the window and all-reduces its
count), so the short last window of an epoch, which Accelerate and Lightning divide by N anyway
(Lightning-AI/pytorch-lightning#19987; fixed in transformers#39659), and uneven shares across
processes are exact too, and nothing is rescaled after the backward. DeepSpeed, which steps
inside `accelerator.backward`, then gets the right gradient as well (benchmarks/deepspeed_cpu_probe.py:
the window-count loss measured 1.0000004 of g*).
"""

from __future__ import annotations

import math

import torch

from ft_accum.core.errors import ConfigError


def window_loss_scale(window_items, backward_divisor: int, num_processes: int):
    """s = N · P / T: what each micro-batch's summed loss is multiplied by before `accelerator.backward`.

    Args:
        window_items: T, the items the loss is a mean over, in the whole window on all processes (a
            number, or a 0-d tensor, which keeps the result on its device without a host read).
        backward_divisor: N, what `accelerator.backward` divides by (the window's micro-batches).
        num_processes: P, what DDP/FSDP average the gradient over.
    """
    if isinstance(window_items, (int, float)) and window_items <= 0:
        raise ValueError(f"an accumulation window must hold at least one item, got {window_items}")
    return backward_divisor * num_processes / window_items


def causal_lm_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and the number of target tokens, counted **after** the causal shift.

    Position t predicts token t+1, so the targets are `labels[:, 1:]`: a row of L labels has at
    most L − 1 targets. Counting `labels != -100` before the shift adds one phantom token per row,
    which is the 2.3e-2 relative gradient error of Accelerate's
    `gradient_accumulation_for_autoregressive_models.py` and of the Trainer for models without a
    `loss_type` (measured in issue 3). Computed from the logits, so it is the same for every causal
    LM, whether or not its forward accepts `num_items_in_batch`; fp32 for a stable log-softmax.
    `label_smoothing` ε: torch's smoothed cross-entropy per target, still summed (the Trainer's
    LabelSmoother took a micro-batch mean, ~N× too large under accumulation: transformers #46731).
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
        label_smoothing=label_smoothing,
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
