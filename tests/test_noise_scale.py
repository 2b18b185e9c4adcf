"""The noise-scale estimator against a least-squares problem whose |G|² and tr Σ are known exactly."""

import pytest
import torch

from ft_accum.core.errors import ConfigError
from ft_accum.core.noise_scale import noise_scale, noise_scale_terms, update_ema
from ft_accum.training.noise_meter import register_micro_batch_hooks


def measured_noise_scale(
    sigma2: float, updates: int = 400, micro: int = 8, accumulation: int = 4, dim: int = 50, seed: int = 0
) -> float:
    """Per-sample loss ½‖w − x‖² with x ~ N(μ, σ²I): per-sample gradients w − x, so G = w − μ,
    |G|² = dim (w − μ = 1), tr Σ = dim·σ², and B_simple = σ². Gradients come from real backward
    passes, accumulated the way the recipes do (summed loss / (micro × N) per micro-batch)."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.ones(dim, dtype=torch.float64))
    mu = torch.zeros(dim, dtype=torch.float64)
    handles, micro_sq = register_micro_batch_hooks([w])
    state = None
    for _ in range(updates):
        w.grad = None
        small = []
        for _ in range(accumulation):
            x = mu + sigma2**0.5 * torch.randn(micro, dim, generator=generator, dtype=torch.float64)
            loss_sum = 0.5 * (w - x).pow(2).sum()
            (loss_sum / (micro * accumulation)).backward()
            small.append(float(micro_sq) * accumulation**2)  # undo the /N: the micro-batch's own mean gradient
            micro_sq.zero_()
        big_sq = float(w.grad.pow(2).sum())
        g2, trace = noise_scale_terms(sum(small) / len(small), big_sq, micro, micro * accumulation)
        state = update_ema(state, g2, trace, beta=0.99)
    for handle in handles:
        handle.remove()
    return noise_scale(state)


@pytest.mark.parametrize("sigma2", [4.0, 40.0])
def test_the_estimate_lands_within_10_percent_of_the_true_noise_scale(sigma2):
    estimate = measured_noise_scale(sigma2)
    assert estimate == pytest.approx(sigma2, rel=0.10), estimate


def test_the_estimate_follows_a_tenfold_change_in_noise():
    low, high = measured_noise_scale(4.0, seed=1), measured_noise_scale(40.0, seed=1)
    assert 8 < high / low < 12.5


def test_the_hooks_do_not_change_the_gradient():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    x, y = torch.randn(10, 6), torch.randn(10, 3)
    torch.nn.functional.mse_loss(model(x), y).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    handles, total = register_micro_batch_hooks(model.parameters())
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    assert float(total) == pytest.approx(sum(float(g.double().pow(2).sum()) for g in plain), rel=1e-6)
    for handle in handles:
        handle.remove()


def test_one_batch_size_is_not_enough():
    with pytest.raises(ConfigError, match="use gradient accumulation ≥ 2"):
        noise_scale_terms(1.0, 1.0, 8, 8)


def test_measuring_does_not_change_the_run_and_logs_the_terms(tmp_path, tiny_model_dir, data_files, capsys):
    from conftest import final_weights, max_abs_difference, read_metrics, run_in_process, tiny_args

    common = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3, "num_train_epochs": 2}
    run_in_process("text_classification", tiny_args(tiny_model_dir, data_files, tmp_path / "plain", **common))
    run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, tmp_path / "measured", measure_noise_scale=True, **common),
    )
    assert max_abs_difference(final_weights(tmp_path / "measured"), final_weights(tmp_path / "plain")) == 0.0
    records = read_metrics(tmp_path / "measured")
    assert all(r["grad_sq_small"] > r["grad_sq_big"] > 0 for r in records), (
        "a micro-batch's gradient is noisier than the window's"
    )
    assert "noise scale" in capsys.readouterr().out


def test_measuring_needs_two_batch_sizes(tmp_path, tiny_model_dir, data_files):
    from conftest import error_of, tiny_args

    message = error_of(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, tmp_path, per_device_train_batch_size=4, measure_noise_scale=True),
    )
    assert "--measure_noise_scale" in message and "--gradient_accumulation_steps ≥ 2" in message


def test_the_estimate_does_not_depend_on_how_the_window_is_split():
    """Effective batch 32 as 4 × 8, 8 × 4 and 16 × 2: the same B_simple within noise (and of the truth)."""
    estimates = [measured_noise_scale(10.0, micro=micro, accumulation=32 // micro, seed=3) for micro in (4, 8, 16)]
    for estimate in estimates:
        assert estimate == pytest.approx(10.0, rel=0.10), estimates
    assert max(estimates) / min(estimates) < 1.15, estimates


def weighted_estimate(sizes_cycle, harmonic: bool, sigma2: float = 10.0, updates: int = 400, dim: int = 50) -> float:
    """Micro-batches of unequal sizes, as token counts are: the library's add_micro_batch and
    window_noise_terms, fed by real backward passes of the token-weighted loss (sum / nominal)."""
    from ft_accum.core.noise_scale import window_noise_terms
    from ft_accum.training.noise_meter import add_micro_batch

    generator = torch.Generator().manual_seed(5)
    w = torch.nn.Parameter(torch.ones(dim, dtype=torch.float64))
    handles, micro_sq = register_micro_batch_hooks([w])
    sums = torch.zeros(3, dtype=torch.float64)
    nominal, accumulation, state = 8, len(sizes_cycle), None
    for _ in range(updates):
        w.grad = None
        for size in sizes_cycle:
            x = sigma2**0.5 * torch.randn(size, dim, generator=generator, dtype=torch.float64)
            (0.5 * (w - x).pow(2).sum() / (nominal * accumulation)).backward()
            add_micro_batch(sums, micro_sq, size / (nominal * accumulation), size)
        total = sum(sizes_cycle)
        w.grad *= nominal * accumulation / total  # the window's true mean, as window.scale makes it
        if not harmonic:  # the naive alternative: the arithmetic mean size as "b"
            sums[1] = sums[2] ** 2 / total
        small, g2, trace = window_noise_terms(sums, float(w.grad.pow(2).sum()), total)
        sums.zero_()
        state = update_ema(state, g2, trace, beta=0.99)
    for handle in handles:
        handle.remove()
    return noise_scale(state)


def test_unequal_micro_batches_are_weighted_by_their_true_share():
    """Sizes 1, 2, 4 and 25 (a mean of 8): the harmonic-mean weighting lands within 10% of the
    true noise scale; taking the arithmetic mean size as b would be far off."""
    assert weighted_estimate([1, 2, 4, 25], harmonic=True) == pytest.approx(10.0, rel=0.10)
    assert not weighted_estimate([1, 2, 4, 25], harmonic=False) == pytest.approx(10.0, rel=0.5)


def test_lm_measurement_is_in_target_tokens_and_does_not_change_the_run(
    tmp_path, tiny_gpt2_dir, lm_data_files, capsys
):
    from conftest import final_weights, max_abs_difference, read_metrics, run_in_process, tiny_lm_args

    common = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "max_train_steps": 4}
    run_in_process("causal_lm", tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path / "plain", **common))
    run_in_process(
        "causal_lm",
        tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path / "measured", measure_noise_scale=True, **common),
    )
    assert max_abs_difference(final_weights(tmp_path / "measured"), final_weights(tmp_path / "plain")) == 0.0
    records = read_metrics(tmp_path / "measured")
    assert all(r["grad_sq_small"] > r["grad_sq_big"] > 0 and "noise_scale" in r for r in records)
    assert "target tokens" in capsys.readouterr().out
