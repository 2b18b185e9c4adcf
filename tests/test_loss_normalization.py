"""The window correction against a real full-batch gradient, without Accelerate in the way."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_accum.core.errors import ConfigError
from ft_accum.core.loss_normalization import (
    check_finite_window,
    check_skipped_updates,
    scale_gradients_,
    window_gradient_scale,
)


def full_batch_gradient(model, x, y):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=3),
    nominal=st.integers(1, 8),
)
def test_corrected_accumulation_equals_the_full_batch_gradient(sizes, nominal):
    """sizes[p][i]: items in micro-batch i on process p; windows may be short and uneven.

    Each process backpropagates S/(c·N) per micro-batch (Accelerate's /N), then the processes'
    gradients are averaged (DDP); the correction must turn that into the mean over all items.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    num_processes, accumulation = len(sizes), max(len(s) for s in sizes)
    batches = [[(torch.randn(n, 5, dtype=torch.double), torch.randint(0, 3, (n,))) for n in proc] for proc in sizes]

    per_process = []
    for proc in batches:
        model.zero_grad()
        for x, y in proc:
            loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
            (loss_sum / nominal / accumulation).backward()
        per_process.append([p.grad.clone() for p in model.parameters()])
    for p, *grads in zip(model.parameters(), *per_process):
        p.grad = torch.stack(grads).mean(0)  # what DDP's all-reduce leaves
    total = sum(sum(proc) for proc in sizes)
    scale_gradients_(model.parameters(), window_gradient_scale(total, nominal, accumulation, num_processes))
    accumulated = torch.cat([p.grad.flatten() for p in model.parameters()])

    x = torch.cat([x for proc in batches for x, _ in proc])
    y = torch.cat([y for proc in batches for _, y in proc])
    expected = full_batch_gradient(model, x, y)
    # float64 throughout: only summation order differs.
    torch.testing.assert_close(accumulated, expected, rtol=1e-12, atol=1e-14)


def test_full_fixed_size_windows_need_no_correction():
    assert (
        window_gradient_scale(window_items=8 * 4 * 2, nominal_items=8, gradient_accumulation_steps=4, num_processes=2)
        == 1.0
    )


def test_short_last_window_is_scaled_up():
    # One micro-batch of 4 in a window of N=4 with c=4: Accelerate divided by 4 too many.
    assert window_gradient_scale(4, 4, 4, 1) == 4.0


def test_empty_window_is_an_error():
    with pytest.raises(ValueError, match="at least one item"):
        window_gradient_scale(0, 8, 4, 1)


def test_a_non_finite_window_names_the_update_micro_batch_and_checkpoint():
    check_finite_window(2.5, [1.0, 1.5], update=3, process_index=0, last_checkpoint=None)  # finite: no error
    with pytest.raises(ConfigError) as error:
        check_finite_window(
            float("nan"),
            [1.0, float("inf"), 2.0],
            update=7,
            process_index=1,
            last_checkpoint="out/checkpoints/step_000006",
        )
    message = str(error.value)
    assert (
        "at update 7, micro-batch 2 of 3 on process 1" in message
        and "nothing was saved after out/checkpoints/step_000006" in message
    )
    with pytest.raises(ConfigError, match="a micro-batch of another process"):
        check_finite_window(float("inf"), [1.0, 2.0], update=7, process_index=0, last_checkpoint=None)


def test_fp16_skipped_updates_stop_the_run_only_when_consecutive_reach_the_limit():
    for consecutive in range(5):
        check_skipped_updates(consecutive, limit=5, update=10, last_checkpoint=None)
    check_skipped_updates(100, limit=0, update=10, last_checkpoint=None)  # 0 = never stop
    with pytest.raises(ConfigError, match="skipped 5 updates in a row .*last good checkpoint: ck.*bf16"):
        check_skipped_updates(5, limit=5, update=10, last_checkpoint="ck")
