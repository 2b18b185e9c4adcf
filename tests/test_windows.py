"""training/windows.py on a real Accelerator: each window is counted before it runs, syncs exactly
once at its last micro-batch (the short last window of an epoch included), and counts the rows
Accelerate repeats as nothing. The equivalence of whole runs is in each recipe's tests and in
`ft-accum check`; these pin the iterator's contract with Accelerate."""

from pathlib import Path

import pytest
import torch

from ft_accum.core.batch_arithmetic import BatchPlan
from ft_accum.testing import reset_accelerate_state
from ft_accum.training.training_state import TrainingState


def accelerator_for_windows(**kwargs):
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    # As run_setup.build_accelerator builds it: a window fetched ahead must not sync at the loader's end.
    plugin = GradientAccumulationPlugin(num_steps=1, sync_with_dataloader=False)
    return Accelerator(cpu=True, gradient_accumulation_plugin=plugin, **kwargs)


class FixedUpdatePlan:
    """The UpdatePlan's interface without a schedule: fixed windows, one LR step each."""

    def __init__(self, num_epochs: int, num_update_steps: int):
        self.num_epochs, self.num_update_steps = num_epochs, num_update_steps

    def at_window_start(self, accelerator, plan, state, *, noise=None):
        return plan

    def lr_steps(self, window):
        return 1


def test_each_window_is_counted_first_and_syncs_once_at_its_last_micro_batch():
    """14 rows at 2 × 4: windows of 4 and 3 micro-batches (8 and 6 rows), two epochs. `accumulate()`
    must sync at exactly the 4th and the 7th micro-batch, although the last window's batches are all
    fetched (so the loader has reached its end) before its first forward; the scale is N/T of each."""
    from torch.utils.data import DataLoader

    from ft_accum.training.windows import TrainWindows

    try:
        accelerator = accelerator_for_windows()
        model = torch.nn.Linear(1, 1)
        loader = DataLoader([{"x": torch.tensor([float(i)])} for i in range(14)], batch_size=2)
        model, loader = accelerator.prepare(model, loader)
        state = TrainingState(effective_batch_size=8)
        windows = TrainWindows(
            accelerator,
            loader,
            state,
            BatchPlan(micro=2, accumulation=4, processes=1),
            count_items=lambda batch: len(batch["x"]),
            update_plan=FixedUpdatePlan(num_epochs=2, num_update_steps=4),
        )
        seen = []
        for window in windows:
            for batch in window:
                with accelerator.accumulate(model):
                    seen.append(
                        (len(batch["x"]), float(window.num_items), float(window.scale), accelerator.sync_gradients)
                    )
            seen.append(("end", window.ends_epoch))
            state.step += 1
            state.scheduler_steps += window.lr_steps
            state.epoch_samples = window.epoch_samples
        first = [(2, 8.0, pytest.approx(4 / 8), False)] * 3 + [(2, 8.0, pytest.approx(4 / 8), True), ("end", False)]
        last = [(2, 6.0, pytest.approx(3 / 6), False)] * 2 + [(2, 6.0, pytest.approx(3 / 6), True), ("end", True)]
        assert seen == (first + last) * 2, seen
        assert state.epoch == 1  # the second epoch ran; the iterator ended after the run's last update
    finally:
        reset_accelerate_state()


def test_start_window_restarts_accelerates_counter_on_a_real_accelerator():
    """start_window writes Accelerate's micro-batch counter (no public way exists); this fails on an
    upgrade that renames it: after a restart mid-count, the next sync must come after exactly N."""
    from ft_accum.training.windows import start_window

    try:
        accelerator = accelerator_for_windows()
        model = accelerator.prepare(torch.nn.Linear(2, 1))
        start_window(accelerator, 3)
        syncs = []
        for _ in range(2):  # two micro-batches of a window of 3, then a window of 4 starts
            with accelerator.accumulate(model):
                syncs.append(accelerator.sync_gradients)
        for _ in range(2):
            start_window(accelerator, 4)
            for _ in range(4):
                with accelerator.accumulate(model):
                    syncs.append(accelerator.sync_gradients)
        assert syncs == [False, False] + [False, False, False, True] * 2
    finally:
        reset_accelerate_state()


def test_only_start_window_writes_the_accelerators_accumulation():
    root = Path(__file__).resolve().parents[1]
    files = [*(root / "recipes").glob("*.py"), *(root / "ft_accum").rglob("*.py")]
    writers = [p.name for p in files if "gradient_accumulation_steps =" in p.read_text()]
    assert writers == ["windows.py"], writers


@pytest.mark.parametrize("retry", [False, True], ids=["plain", "out-of-memory-retry"])
def test_a_repeat_counts_nothing_and_a_resplit_window_keeps_its_count(retry):
    """A micro-batch of Accelerate's repeats has scale 0 and adds no items; an out-of-memory error in a
    window re-splits it into smaller micro-batches with the same count, and runs it again from the start."""
    from ft_accum.training.windows import Window

    try:
        accelerator = accelerator_for_windows()
        batches = [{"x": torch.ones(4, 1)}, {"x": torch.ones(4, 1)}, {"x": torch.ones(4, 1)}]
        window = Window(
            accelerator,
            batches,
            count_items=lambda batch: len(batch["x"]),
            plan=BatchPlan(4, 3, 1),
            real=[True, True, False],
        )
        shrunk = []
        window.on_out_of_memory = lambda exc: shrunk.append(exc) or BatchPlan(2, 6, 1)
        failed, seen = False, []
        for batch in window:
            with window.retry_on_out_of_memory():
                seen.append((len(batch["x"]), float(window.scale)))
                if retry and not failed and len(seen) == 2:
                    failed = True
                    raise torch.OutOfMemoryError("CUDA out of memory")
        summary = window.summary()
        assert summary["items"] == 8 and summary["samples"] == 8
        if retry:
            assert len(shrunk) == 1 and window.plan == BatchPlan(2, 6, 1)
            assert seen[:2] == [(4, pytest.approx(3 / 8))] * 2
            assert seen[2:] == [(2, pytest.approx(6 / 8))] * 4 + [(2, 0.0)] * 2
        else:
            assert seen == [(4, pytest.approx(3 / 8)), (4, pytest.approx(3 / 8)), (4, 0.0)]
        with pytest.raises(RuntimeError, match="size mismatch"):  # only out-of-memory errors are retried
            for _ in window:
                with window.retry_on_out_of_memory():
                    raise RuntimeError("size mismatch")
    finally:
        reset_accelerate_state()
