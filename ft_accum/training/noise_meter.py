"""`--measure_noise_scale`: the per-micro-batch gradient statistics of core/noise_scale.py, read by
hooks, so the training loop makes no call for it.

A hook on each parameter tensor sees the gradient of the current backward before it is added to
`.grad`, so `register_micro_batch_hooks` sums its squares there: no gradient copy. The window
(training/windows.py) tells the meter when a micro-batch's backward is done and what it was scaled
by; the tracker reads the update's columns at its end.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ft_accum.core.errors import ConfigError
from ft_accum.core.noise_scale import advise_effective_batch, noise_scale, update_ema, window_noise_terms


def register_micro_batch_hooks(parameters: Iterable[torch.nn.Parameter]) -> tuple[list, torch.Tensor]:
    """Hooks that add each backward's Σ grad² into a one-element tensor; returns (handles, that tensor).

    Read and zero the tensor after each micro-batch's backward. The hooks see the gradient of the
    loss that was backpropagated (scaled as it was), on this process, before DDP averages it.
    """
    parameters = [p for p in parameters if p.requires_grad]
    if not parameters:
        raise ConfigError("no trainable parameters to measure the noise scale on")
    total = torch.zeros((), dtype=torch.float64, device=parameters[0].device)

    def add(grad: torch.Tensor) -> None:
        # vector_norm reduces in one pass without materialising grad², which `pow(2).sum()` would.
        half = grad.dtype in (torch.float16, torch.bfloat16)  # accumulate those in fp32
        total.add_(torch.linalg.vector_norm(grad.detach(), dtype=torch.float32 if half else None).double().square())

    return [p.register_hook(add) for p in parameters], total


def start_noise_scale_measurement(
    parameters: Iterable[torch.nn.Parameter], gradient_accumulation_steps: int, num_processes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hook the trainable `parameters`; returns (the hooks' per-backward Σ grad², the window's sums).

    The window's sums are [Σ |g_b|², Σ 1/b, number of micro-batches] over its micro-batches
    (`add_micro_batch`), read at the sync step by `window_noise_terms`. Refuses a run with one
    micro-batch per update: it has no small batch to compare with.
    """
    if gradient_accumulation_steps * num_processes < 2:
        raise ConfigError(
            "--measure_noise_scale compares micro-batch and window gradients, so it needs "
            "--gradient_accumulation_steps ≥ 2 (or several processes)"
        )
    _, micro_grad_sq = register_micro_batch_hooks(parameters)
    return micro_grad_sq, torch.zeros(3, dtype=torch.float64, device=micro_grad_sq.device)


def add_micro_batch(
    window_sums: torch.Tensor, micro_grad_sq: torch.Tensor, backward_scale: float, size: float
) -> None:
    """Add one micro-batch of `size` items (samples or target tokens) to the window's sums; zero the hooks' total.

    `backward_scale` is what the backward multiplied this micro-batch's *mean* gradient by
    (its share of the window's normalisation, times the fp16 loss scale), so dividing it out
    gives |g_b|² of the micro-batch alone.
    """
    window_sums[0] += micro_grad_sq / backward_scale**2
    window_sums[1] += 1.0 / size
    window_sums[2] += 1
    micro_grad_sq.zero_()


class NoiseScaleMeter:
    """Two statistics per update and a line of advice at the end of the run.

    `unit` is what the loss is a mean over: "samples", or a kind of token ("target tokens",
    "labelled tokens") for token-weighted losses; the noise scale is measured in that unit. The EMA
    lives in the training state, so a resume carries it on.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], plan, unit: str = "samples"):
        self.unit = unit
        # hooks see each micro-batch's own gradient before it is added to .grad
        self.micro_grad_sq, self.sums = start_noise_scale_measurement(parameters, plan.accumulation, plan.processes)

    def start_window(self) -> None:
        """A window starts (or restarts after an out-of-memory retry): nothing of it is counted yet."""
        self.sums.zero_()
        self.micro_grad_sq.zero_()

    def after_micro_batch(self, accelerator, *, backward_scale: float, size: float) -> None:
        """After a micro-batch's backward: its hooks saw its mean gradient × `backward_scale` (× the fp16 loss scale)."""
        loss_scale = accelerator.scaler.get_scale() if accelerator.scaler else 1.0
        add_micro_batch(self.sums, self.micro_grad_sq, backward_scale * loss_scale, size)

    def at_sync(
        self, accelerator, *, grad_norm: float, window_items: float, ema: dict | None
    ) -> tuple[dict, dict[str, float]]:
        """(the running averages `ema` after this update, the update's metrics.jsonl columns). Small batch:
        one micro-batch (per process); big batch: the whole window on all processes, whose gradient norm
        (before clipping) is `grad_norm`. The caller keeps the averages in the training state."""
        big_sq = grad_norm**2
        small, g2, trace = window_noise_terms(accelerator.reduce(self.sums, reduction="sum"), big_sq, window_items)
        ema = update_ema(ema, g2, trace)
        # noise_scale_batch: this update's batch in the noise scale's unit
        return ema, {
            "noise_scale": noise_scale(ema),
            "grad_sq_small": small,
            "grad_sq_big": big_sq,
            "noise_scale_batch": window_items,
        }

    def in_samples(self, state) -> float | None:
        """The measured noise scale in samples (what an accumulation schedule counts), or None before the first."""
        if not state.noise_scale_ema:
            return None
        measured = noise_scale(state.noise_scale_ema)
        return measured if self.unit == "samples" else measured * state.samples_seen / state.items_seen

    def advice(self, state) -> str | None:
        """The end-of-run line of `advise_effective_batch`, at the run's mean batch in the meter's unit."""
        if not state.noise_scale_ema:
            return None
        batch = state.effective_batch_size if self.unit == "samples" else round(state.items_seen / state.step)
        return advise_effective_batch(noise_scale(state.noise_scale_ema), batch, self.unit)
