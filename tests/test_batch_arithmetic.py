import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ft_accum.core.batch_arithmetic import (
    effective_batch_size,
    num_update_steps,
    resolve_gradient_accumulation_steps,
    updates_per_epoch,
)
from ft_accum.core.errors import ConfigError


@given(micro=st.integers(1, 64), accumulation=st.integers(1, 64), processes=st.integers(1, 16))
def test_effective_batch_round_trips_to_the_accumulation(micro, accumulation, processes):
    effective = effective_batch_size(micro, accumulation, processes)
    assert effective == micro * accumulation * processes
    assert resolve_gradient_accumulation_steps(micro, processes, effective_batch_size=effective) == accumulation


def test_accumulation_given_directly_or_defaulted():
    assert resolve_gradient_accumulation_steps(8, 1, gradient_accumulation_steps=3) == 3
    assert resolve_gradient_accumulation_steps(8, 2) == 1


def test_indivisible_effective_batch_suggests_nearest_settings():
    with pytest.raises(ConfigError) as err:
        resolve_gradient_accumulation_steps(4, 1, effective_batch_size=10)
    message = str(err.value)
    assert "not divisible" in message and "8 or 12" in message
    # 10 = 5 × 2, and 5 > 4 would not fit, so the largest micro-batch ≤ 4 that divides 10 is 2.
    assert "--per_device_train_batch_size 2" in message


def test_indivisible_over_processes_names_the_process_count():
    with pytest.raises(ConfigError, match=r"4 × 2 process\(es\) = 8; use --effective_batch_size 8 or 16"):
        resolve_gradient_accumulation_steps(4, 2, effective_batch_size=12)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"gradient_accumulation_steps": 0}, "must be ≥ 1"),
        ({"gradient_accumulation_steps": -2}, "must be ≥ 1"),
        ({"effective_batch_size": 0}, "must be ≥ 1"),
        ({"gradient_accumulation_steps": 2, "effective_batch_size": 16}, "give only one"),
    ],
)
def test_bad_accumulation_settings_are_rejected(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        resolve_gradient_accumulation_steps(8, 1, **kwargs)


@pytest.mark.parametrize("batches, accumulation, expected", [(12, 4, 3), (13, 4, 4), (3, 4, 1), (1, 1, 1)])
def test_updates_per_epoch_counts_the_short_last_window(batches, accumulation, expected):
    assert updates_per_epoch(batches, accumulation) == expected


def test_num_update_steps():
    assert num_update_steps(13, 4, num_train_epochs=3) == 12
    assert num_update_steps(13, 4, num_train_epochs=3, max_train_steps=5) == 5
    with pytest.raises(ConfigError, match="no batches"):
        num_update_steps(0, 4, num_train_epochs=1)


def test_shrinking_the_micro_batch_keeps_the_effective_batch():
    from ft_accum.core.batch_arithmetic import BatchPlan

    for (micro, accumulation), expected in {(8, 2): (4, 4), (6, 1): (3, 2), (9, 1): (3, 3), (7, 2): (1, 14)}.items():
        plan = BatchPlan(micro, accumulation, 2)
        smaller = plan.shrunk()
        assert (smaller.micro, smaller.accumulation) == expected
        assert smaller.effective == plan.effective and smaller.processes == 2
    with pytest.raises(ConfigError, match="cannot shrink further"):
        BatchPlan(1, 32, 1).shrunk()


@given(
    micro=st.integers(1, 16), accumulation=st.integers(1, 16), processes=st.integers(1, 8), factor=st.integers(1, 8)
)
def test_a_plan_resplits_to_any_effective_batch_its_micro_batches_divide(micro, accumulation, processes, factor):
    from ft_accum.core.batch_arithmetic import BatchPlan

    plan = BatchPlan(micro, accumulation, processes)
    assert plan.effective == micro * accumulation * processes
    bigger = plan.resplit(plan.effective * factor)
    assert (bigger.micro, bigger.processes, bigger.accumulation) == (micro, processes, accumulation * factor)
    if micro * processes > 1:
        with pytest.raises(ConfigError, match="not divisible"):
            plan.resplit(plan.effective * factor + 1)


def test_out_of_memory_errors_are_recognised():
    from ft_accum.training.memory import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as exc:
        assert is_out_of_memory(exc)
    assert not is_out_of_memory(RuntimeError("size mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))
