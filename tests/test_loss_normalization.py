"""The window correction against a real full-batch gradient, without Accelerate in the way."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ft_accum.core.errors import ConfigError
from ft_accum.core.loss_normalization import (
    check_finite_window,
    check_skipped_updates,
    window_loss_scale,
)


def full_batch_gradient(model, x, y):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=4), min_size=1, max_size=3))
def test_the_window_scale_makes_accumulation_equal_the_full_batch_gradient(sizes):
    """sizes[p][i]: items in micro-batch i on process p; windows may be short and uneven.

    Each process backpropagates S · s / N per micro-batch (s = window_loss_scale, then Accelerate's
    /N), then the processes' gradients are averaged (DDP): that must be the mean over all items.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).double()
    num_processes, accumulation = len(sizes), max(len(s) for s in sizes)
    batches = [[(torch.randn(n, 5, dtype=torch.double), torch.randint(0, 3, (n,))) for n in proc] for proc in sizes]
    total = sum(sum(proc) for proc in sizes)
    scale = window_loss_scale(total, accumulation, num_processes)

    per_process = []
    for proc in batches:
        model.zero_grad()
        for x, y in proc:
            loss_sum = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
            (loss_sum * scale / accumulation).backward()
        per_process.append([p.grad.clone() for p in model.parameters()])
    for p, *grads in zip(model.parameters(), *per_process):
        p.grad = torch.stack(grads).mean(0)  # what DDP's all-reduce leaves
    accumulated = torch.cat([p.grad.flatten() for p in model.parameters()])

    x = torch.cat([x for proc in batches for x, _ in proc])
    y = torch.cat([y for proc in batches for _, y in proc])
    expected = full_batch_gradient(model, x, y)
    # float64 throughout: only summation order differs.
    torch.testing.assert_close(accumulated, expected, rtol=1e-12, atol=1e-14)


def test_the_window_scale_undoes_backwards_division_and_ddps_average():
    # 8 micro × 4 accumulation × 2 processes = 64 items: N·P/T = 4·2/64.
    assert window_loss_scale(window_items=64, backward_divisor=4, num_processes=2) == 0.125
    # A short last window of one micro-batch of 4 items: Accelerate divides by that window's N = 1.
    assert window_loss_scale(4, 1, 1) == 0.25


def test_empty_window_is_an_error():
    with pytest.raises(ValueError, match="at least one item"):
        window_loss_scale(0, 4, 1)


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
