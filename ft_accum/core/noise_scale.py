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
sum: training/noise_meter.py hooks the parameters to read it (no gradient copy).
"""

from __future__ import annotations

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
