"""The gradient noise scale from the statistics that accumulation gives for free.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (arXiv:1812.06162): the
critical batch size is predicted by the simple noise scale

    B_simple = tr(Σ) / |G|²

with G the true gradient and Σ the per-sample gradient covariance. Each accumulated update
measures the gradient at two batch sizes, every micro-batch (b items) and the window (B = N·b
items on all processes), and from E|g_b|² = |G|² + tr(Σ)/b (their Appendix A):

    |G|²  ≈ (B·|g_B|² − b·|g_b|²) / (B − b)
    tr(Σ) ≈ (|g_b|² − |g_B|²) / (1/b − 1/B)

Both estimates are unbiased but noisy, and their ratio is not, so each is smoothed with its own
EMA and only then divided (as gpt-neox does). Units: samples for fixed-size tasks, target tokens
for the token-weighted LM loss.

|g_b|² needs the gradient of each micro-batch *alone*, while `.grad` only holds their running
sum. A hook on each parameter tensor sees the gradient of the current backward before it is
added to `.grad`, so `register_micro_batch_hooks` sums its squares there: no gradient copy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ft_accum.core.errors import ConfigError


def noise_scale_terms(small_sq: float, big_sq: float, small_batch: float, big_batch: float) -> tuple[float, float]:
    """(|G|², tr Σ) estimates from |g_b|² at batch b and |g_B|² at batch B (McCandlish et al., App. A)."""
    if not big_batch > small_batch > 0:
        raise ConfigError(
            f"the noise scale needs two batch sizes, got micro-batch {small_batch} and window {big_batch}; "
            "use gradient accumulation ≥ 2 (or several processes)"
        )
    g2 = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    trace = (small_sq - big_sq) / (1 / small_batch - 1 / big_batch)
    return g2, trace


def update_ema(state: dict[str, float] | None, g2: float, trace: float, beta: float = 0.95) -> dict[str, float]:
    """EMAs of |G|² and tr Σ, bias-corrected as in Adam so the first updates are not pulled to 0."""
    state = dict(state or {"g2": 0.0, "trace": 0.0, "count": 0})
    state["g2"] = beta * state["g2"] + (1 - beta) * g2
    state["trace"] = beta * state["trace"] + (1 - beta) * trace
    state["count"] += 1
    state["beta"] = beta
    return state


def noise_scale(state: dict[str, float]) -> float:
    """B_simple = EMA(tr Σ) / EMA(|G|²); inf while the |G|² estimate is not positive (noise dominates)."""
    correction = 1 - state["beta"] ** state["count"]
    g2, trace = state["g2"] / correction, state["trace"] / correction
    return trace / g2 if g2 > 0 else float("inf")


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
    model: torch.nn.Module, gradient_accumulation_steps: int, num_processes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hook the trainable parameters of `model`; returns (the hooks' per-backward Σ grad², the window's sums).

    The window's sums are [Σ |g_b|², Σ 1/b, number of micro-batches] over its micro-batches
    (`add_micro_batch`), read at the sync step by `window_noise_terms`. Refuses a run with one
    micro-batch per update: it has no small batch to compare with.
    """
    if gradient_accumulation_steps * num_processes < 2:
        raise ConfigError(
            "--measure_noise_scale compares micro-batch and window gradients, so it needs "
            "--gradient_accumulation_steps ≥ 2 (or several processes)"
        )
    _, micro_grad_sq = register_micro_batch_hooks(model.parameters())
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


def window_noise_terms(window_sums: torch.Tensor, big_sq: float, window_size: float) -> tuple[float, float, float]:
    """(mean |g_b|², |G|², tr Σ) for one update, from the window's sums over all processes.

    Micro-batches of unequal size b_i (token counts, a short last batch) are weighted by their true
    share: E|g_bi|² = |G|² + tr Σ / b_i, so their mean is |G|² + tr Σ · mean(1/b_i), which is the
    two-batch formula with b = the harmonic mean of the b_i.
    """
    sum_sq, sum_inverse, count = window_sums.tolist()
    small = sum_sq / count
    return (small, *noise_scale_terms(small, big_sq, count / sum_inverse, window_size))


def advise_effective_batch(measured_noise_scale: float, effective_batch_size: int, unit: str = "samples") -> str:
    """One line of advice from the measured noise scale, with its uncertainty.

    McCandlish et al. find the critical batch within a small factor of B_simple: well below it,
    more samples per update cut the number of updates almost proportionally; well above it,
    they buy little. The estimate is an EMA over a run whose noise scale drifts (it usually grows
    as the loss falls), so it is read as a range of ×2 either way, not as a number.
    """
    if not measured_noise_scale < float("inf"):
        return (
            f"noise scale: not measurable yet (the gradient signal is below its noise at effective batch {effective_batch_size:,} {unit}); "
            "run longer, or raise the accumulation"
        )
    ratio = measured_noise_scale / effective_batch_size
    size = f"~{measured_noise_scale:,.0f} {unit} (read it as {measured_noise_scale / 2:,.0f}–{measured_noise_scale * 2:,.0f})"
    if ratio > 2:
        return (
            f"effective batch {effective_batch_size:,} {unit} is below the measured noise scale {size}: raising the accumulation "
            f"toward ~{measured_noise_scale:,.0f} should cut the number of updates with little extra compute"
        )
    if ratio < 0.5:
        return (
            f"effective batch {effective_batch_size:,} {unit} is above the measured noise scale {size}: a smaller effective batch "
            "(less accumulation) should reach the same loss with fewer samples"
        )
    return f"effective batch {effective_batch_size:,} {unit} is near the measured noise scale {size}: a good size for this run"


class NoiseScaleMeter:
    """`--measure_noise_scale` in a recipe: two hooks and a line of advice at the end.

    `after_backward` after each micro-batch's backward, `at_sync` once per update (it returns the
    metrics.jsonl columns and keeps the EMA in the training state, so a resume carries it on).
    `unit` is what the loss is a mean over: "samples", or a kind of token ("target tokens",
    "labelled tokens") for token-weighted losses, whose counts the training state keeps in
    `tokens_seen`; the noise scale is measured in that unit. Disabled, every hook is a no-op.
    """

    def __init__(self, enabled: bool, model: torch.nn.Module, plan, unit: str = "samples"):
        self.enabled, self.unit = enabled, unit
        if enabled:  # hooks see each micro-batch's own gradient before it is added to .grad
            self.micro_grad_sq, self.sums = start_noise_scale_measurement(model, plan.accumulation, plan.processes)

    def after_backward(self, accelerator, items, nominal_items: float, plan) -> None:
        """The hooks saw ∇(summed loss)/(nominal·N)·loss scale = the micro-batch's mean gradient × items/(nominal·N)·scale."""
        if self.enabled:
            loss_scale = accelerator.scaler.get_scale() if accelerator.scaler else 1.0
            add_micro_batch(
                self.sums,
                self.micro_grad_sq,
                float(items) / (nominal_items * plan.accumulation) * loss_scale,
                float(items),
            )

    def at_sync(self, accelerator, totals, state) -> dict[str, float]:
        """Small batch: one micro-batch (per process); big batch: the whole window on all processes."""
        if not self.enabled:
            return {}
        big_sq = totals.grad_norm**2
        small, g2, trace = window_noise_terms(accelerator.reduce(self.sums, reduction="sum"), big_sq, totals.items)
        self.sums.zero_()
        state.noise_scale_ema = update_ema(state.noise_scale_ema, g2, trace)
        # noise_scale_batch: this update's batch in the noise scale's unit
        return {
            "noise_scale": noise_scale(state.noise_scale_ema),
            "grad_sq_small": small,
            "grad_sq_big": big_sq,
            "noise_scale_batch": totals.items,
        }

    def in_samples(self, state) -> float | None:
        """The measured noise scale in samples (what an accumulation schedule counts), or None before the first."""
        if not state.noise_scale_ema:
            return None
        measured = noise_scale(state.noise_scale_ema)
        return measured if self.unit == "samples" else measured * state.samples_seen / state.tokens_seen

    def advice(self, state) -> str | None:
        """The end-of-run line of `advise_effective_batch`, at the run's mean batch in the meter's unit."""
        if not (self.enabled and state.noise_scale_ema):
            return None
        batch = state.effective_batch_size if self.unit == "samples" else round(state.tokens_seen / state.step)
        return advise_effective_batch(noise_scale(state.noise_scale_ema), batch, self.unit)
