"""--accumulation_schedule: the parser, the plan, and runs checked against a plain-PyTorch full-batch loop.

The claim: a run whose effective batch changes mid-run makes exactly the updates of a plain loop
that takes the same samples in the same order, in full batches of the scheduled sizes, with the
LR-scaling policy re-applied at each change and the LR schedule sized to the real updates.
"""

import pytest
import torch
from conftest import (
    copy_checkpoint,
    error_of,
    final_weights,
    max_abs_difference,
    read_metrics,
    relative_error,
    run_in_process,
    tiny_args,
)

from ft_accum.core import batch_arithmetic
from ft_accum.core.accumulation_schedule import (
    AccumulationSchedule,
    adaptive_effective_batch,
    check_schedule,
    parse_accumulation_schedule,
    plan_windows,
    scheduler_advance,
)
from ft_accum.core.errors import ConfigError
from ft_accum.training.update_plan import set_peak_learning_rate


def test_parse_updates_epochs_and_adaptive():
    assert parse_accumulation_schedule("100:64, 300:128") == AccumulationSchedule("update", ((100, 64), (300, 128)))
    assert parse_accumulation_schedule("epoch1:64,epoch2:128") == AccumulationSchedule("epoch", ((1, 64), (2, 128)))
    assert parse_accumulation_schedule("adaptive") == AccumulationSchedule("adaptive")
    assert parse_accumulation_schedule("adaptive:max=256,factor=1.5,patience=4") == AccumulationSchedule(
        "adaptive", (), 256, 1.5, 4
    )
    assert parse_accumulation_schedule(None) is None and parse_accumulation_schedule("  ") is None


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("100=64", "cannot read '100=64'"),
        ("100:64,epoch2:128", "mixes updates and epochs"),
        ("300:64,100:128", "the starts must increase"),
        ("0:64", "list only the changes"),
        ("10:0", "must be ≥ 1"),
        ("adaptive:cap=64", "unknown adaptive option 'cap=64'"),
        ("adaptive:max=big", "max and patience are integers"),
    ],
)
def test_malformed_schedules_name_the_problem_and_the_format(text, fragment):
    with pytest.raises(ConfigError, match="accumulation_schedule") as info:
        parse_accumulation_schedule(text)
    assert fragment in str(info.value)


def test_a_scheduled_batch_that_does_not_divide_suggests_the_nearest_that_do():
    with pytest.raises(ConfigError, match=r"entry 5:12 is not divisible .* = 8; use 5:8 or 5:16"):
        check_schedule(parse_accumulation_schedule("5:12"), 4, 2, 8)
    with pytest.raises(ConfigError, match="max=4 is below the starting effective batch 8"):
        check_schedule(parse_accumulation_schedule("adaptive:max=4"), 4, 1, 8)


@pytest.mark.parametrize(
    "batches, accumulation, epochs, max_steps",
    [(10, 4, 3, None), (12, 4, 2, None), (7, 1, 2, 5), (9, 16, 2, None), (2, 4, 1, 3)],
)
def test_without_a_schedule_the_plan_is_the_plain_batch_arithmetic(batches, accumulation, epochs, max_steps):
    plan = plan_windows(batches, epochs, 2, 1, 2 * accumulation, None, max_steps)
    assert sum(map(len, plan)) == batch_arithmetic.num_update_steps(batches, accumulation, epochs, max_steps)
    assert all(sum(windows) == batches for windows in plan[:-1])


def test_a_plan_follows_the_schedule_and_never_spans_an_epoch():
    # 10 micro-batches of 2 per epoch, starting at 4 samples (2 micro-batches); 8 from update 3, 20 from update 6.
    plan = plan_windows(10, 2, 2, 1, 4, parse_accumulation_schedule("3:8,6:20"))
    assert plan == [[2, 2, 2, 4], [4, 4, 2]]  # update 6 would take 10 micro-batches; 2 are left in the epoch
    assert plan_windows(10, 3, 2, 1, 4, parse_accumulation_schedule("epoch1:8,epoch2:20")) == [
        [2] * 5,
        [4, 4, 2],
        [10],
    ]


def test_adaptive_scheduler_steps_add_up_to_the_plan_at_the_starting_batch():
    """Windows of 1, 2 and 4 × the start, then the short tail of the epoch: each epoch still advances
    the scheduler by the count planned at the starting batch, so the LR ends with the data."""
    schedule, start, per_batch = AccumulationSchedule("adaptive"), 8, 2  # 4 micro-batches of 2 per window at the start
    batches = 50
    planned = len(plan_windows(batches, 1, per_batch, 1, start, schedule)[0])
    windows = [4, 4, 8, 8, 16, 8 + 2]  # micro-batches; the last epoch window is short
    assert sum(windows) == batches
    assert sum(scheduler_advance(schedule, w * per_batch, start) for w in windows) == planned == 13


def test_adaptive_doubles_only_past_the_factor_after_patience_and_below_the_cap():
    schedule = AccumulationSchedule("adaptive", max_effective_batch_size=64, factor=2.0, patience=5)
    assert adaptive_effective_batch(schedule, 100.0, 32, 16, 5) == 64
    assert adaptive_effective_batch(schedule, 60.0, 32, 16, 5) == 32  # 60 < 2 × 32
    assert adaptive_effective_batch(schedule, 100.0, 32, 16, 4) == 32  # within patience
    assert adaptive_effective_batch(schedule, float("inf"), 64, 16, 9) == 64  # at the cap
    assert adaptive_effective_batch(schedule, None, 16, 16, 9) == 16  # nothing measured yet
    assert adaptive_effective_batch(schedule, float("inf"), 16, 16, 9) == 32  # |G|² not yet positive: noise dominates


def test_a_new_peak_lr_rescales_a_running_linear_schedule():
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=2, num_training_steps=10)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 6 / 8)
    set_peak_learning_rate(optimizer, scheduler, 0.2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * 6 / 8)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * 5 / 8)


def full_batch_reference(model_dir, rows, order_seed, epochs, batch_sizes, peaks, momentum=0.9):
    """Plain PyTorch: full batches of the scheduled sizes over Accelerate's seeded sample order, SGD
    with the given peak LR per update and linear decay to 0 over the real updates."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    label_ids = {name: i for i, name in enumerate(sorted({r["label"] for r in rows}))}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=momentum)
    total, update = len(batch_sizes), 0
    for epoch in range(epochs):
        # SeedableRandomSampler: a RandomSampler whose generator is seeded with data_seed + epoch.
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(order_seed + epoch)).tolist()
        position = 0
        while position < len(order) and update < total:
            chunk = [rows[i] for i in order[position : position + batch_sizes[update]]]
            position += len(chunk)
            batch = tokenizer(
                [r["text"] for r in chunk], padding=True, truncation=True, max_length=48, return_tensors="pt"
            )
            loss = model(**batch, labels=torch.tensor([label_ids[r["label"]] for r in chunk])).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.param_groups[0]["lr"] = peaks[update] * (total - update) / total
            optimizer.step()
            update += 1
    assert update == total
    return {k: v.contiguous() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "schedule, epochs, sizes",
    [
        # 48 samples: 3 updates of 4, then 8s; the change lands mid-window of Accelerate's micro-batch
        # counter (6 is no multiple of 4) and the epoch ends with a short window of 4.
        ("3:8", 1, [4] * 3 + [8] * 4 + [4]),
        ("epoch1:16", 2, [4] * 12 + [16] * 3),
    ],
)
def test_a_scheduled_run_equals_full_batches_of_the_scheduled_sizes(
    tmp_path, tiny_model_dir, data_files, schedule, epochs, sizes
):
    """Micro-batch 2 throughout; linear LR scaling from 0.1 at batch 4 gives each update's peak LR
    from the *scheduled* batch (the short last window keeps the LR of its phase)."""
    import json

    rows = [json.loads(line) for line in data_files["train"].read_text().splitlines()]
    run_in_process(
        "text_classification",
        tiny_args(
            tiny_model_dir,
            data_files,
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            accumulation_schedule=schedule,
            optim="sgd",
            learning_rate=0.1,
            base_batch_size=4,
            lr_scaling="linear",
            max_grad_norm=0,
            num_train_epochs=epochs,
        ),
    )
    records = read_metrics(tmp_path)
    scheduled = [r["effective_batch_size"] for r in records]
    assert [
        b - a for a, b in zip([0] + [r["samples_seen"] for r in records], [r["samples_seen"] for r in records])
    ] == sizes
    expected = full_batch_reference(tiny_model_dir, rows, 7, epochs, sizes, [0.1 * s / 4 for s in scheduled])
    initial = final_weights_initial(tiny_model_dir)
    ours = final_weights(tmp_path)
    # Compare the updates w − w0: a wrong LR or a wrong batch is then an O(1) error, not diluted by w0.
    assert relative_error({k: ours[k] - initial[k] for k in ours}, {k: expected[k] - initial[k] for k in ours}) <= 1e-4


def final_weights_initial(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


ADAPTIVE = {
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "num_train_epochs": 2,
    "accumulation_schedule": "adaptive:max=16,factor=0.01,patience=2",
}


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory, tiny_model_dir, data_files):
    """factor 0.01: any measured noise scale exceeds it, so the batch doubles every 2 updates up to the cap."""
    out = tmp_path_factory.mktemp("adaptive")
    run_in_process(
        "text_classification", tiny_args(tiny_model_dir, data_files, out, checkpointing_steps=1, **ADAPTIVE)
    )
    return out


def test_adaptive_grows_in_powers_of_two_to_the_cap_and_the_lr_ends_with_the_data(adaptive_run):
    records = read_metrics(adaptive_run)
    sizes = [r["effective_batch_size"] for r in records]
    assert sizes[:2] == [4, 4] and sizes[2:4] == [8, 8] and max(sizes) == 16, sizes
    assert sizes == sorted(sizes) and set(sizes) == {4, 8, 16}
    assert records[-1]["samples_seen"] == 96 and records[-1]["lr"] == 0.0
    assert all(r["lr"] > 0 for r in records[:-1])
    assert all("noise_scale" in r for r in records)


def test_adaptive_equals_the_fixed_schedule_of_its_decisions(tmp_path, adaptive_run, tiny_model_dir, data_files):
    """Replaying the adaptive run's batch sizes as a fixed schedule gives the same weights (constant LR,
    since the two size their LR schedules differently). Together with the full-batch test above, the
    adaptive run is a sequence of exact full-batch updates."""
    records = read_metrics(adaptive_run)
    changes = [
        f"{i}:{r['effective_batch_size']}"
        for i, r in enumerate(records)
        if i and r["effective_batch_size"] != records[i - 1]["effective_batch_size"]
    ]
    out = tmp_path / "adaptive-constant"
    run_in_process(
        "text_classification", tiny_args(tiny_model_dir, data_files, out, lr_scheduler_type="constant", **ADAPTIVE)
    )
    fixed = tmp_path / "fixed"
    run_in_process(
        "text_classification",
        tiny_args(
            tiny_model_dir,
            data_files,
            fixed,
            lr_scheduler_type="constant",
            **{**ADAPTIVE, "accumulation_schedule": ",".join(changes)},
        ),
    )
    assert [r["effective_batch_size"] for r in read_metrics(out)] == [r["effective_batch_size"] for r in records]
    assert max_abs_difference(final_weights(out), final_weights(fixed)) == 0.0


def test_an_adaptive_run_resumed_after_a_change_is_bit_identical(tmp_path, adaptive_run, tiny_model_dir, data_files):
    """Resume from the checkpoint two updates after the first doubling: the batch size, the noise-scale
    EMA, the data position and the LR schedule must all come back."""
    records = read_metrics(adaptive_run)
    step = next(i for i, r in enumerate(records) if r["effective_batch_size"] == 8) + 2
    out = copy_checkpoint(adaptive_run, step, tmp_path / "resumed")
    run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, out, resume_from_checkpoint="latest", checkpointing_steps=1, **ADAPTIVE),
    )
    assert [r["effective_batch_size"] for r in read_metrics(out)] == [
        r["effective_batch_size"] for r in records[step:]
    ]
    assert max_abs_difference(final_weights(out), final_weights(adaptive_run)) == 0.0


def test_a_run_resumed_at_an_epoch_boundary_is_bit_identical(tmp_path, tiny_model_dir, data_files):
    """A checkpoint from the last window of epoch 0 has consumed the whole epoch: the resume must
    start epoch 1 at its first batch."""
    common = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "num_train_epochs": 2,
        "accumulation_schedule": "epoch1:16",
    }
    run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, tmp_path / "full", checkpointing_steps=6, **common),
    )
    out = copy_checkpoint(tmp_path / "full", 6, tmp_path / "resumed")
    run_in_process(
        "text_classification", tiny_args(tiny_model_dir, data_files, out, resume_from_checkpoint="latest", **common)
    )
    assert [r["samples_seen"] for r in read_metrics(out)] == [
        r["samples_seen"] for r in read_metrics(tmp_path / "full")
    ][6:]
    assert max_abs_difference(final_weights(out), final_weights(tmp_path / "full")) == 0.0


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ({"accumulation_schedule": "10-64"}, ["cannot read '10-64'", "UPDATE:EFFECTIVE_BATCH"]),
        (
            {"accumulation_schedule": "2:6", "per_device_train_batch_size": 4},
            ["entry 2:6 is not divisible", "use 2:4 or 2:8"],
        ),
        ({"accumulation_schedule": "adaptive", "gradient_accumulation_steps": 1}, ["--measure_noise_scale", "≥ 2"]),
    ],
)
def test_bad_schedules_stop_with_one_line(tmp_path, tiny_model_dir, data_files, overrides, fragments):
    message = error_of(
        "text_classification",
        tiny_args(
            tiny_model_dir,
            data_files,
            tmp_path,
            **{"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, **overrides},
        ),
    )
    for fragment in fragments:
        assert fragment in message, message
