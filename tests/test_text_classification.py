"""recipes/text_classification.py against real full-batch runs, in-process and through `accelerate launch`.

Tolerances (RTOL in conftest): all runs are fp32 with dropout 0 on the same samples per update, so
they differ only in summation order (micro-batch shapes, padding lengths, the all-reduce).
"""

import json
import re

import pytest
import torch
from conftest import (
    assert_same_run,
    final_weights,
    launch_runs,
    make_rows,
    read_evaluations,
    read_metrics,
    relative_error,
    run_in_process,
    tiny_args,
    write_jsonl,
)
from safetensors.torch import load_file

UPDATE_RTOL = 1e-4


@pytest.fixture(scope="module")
def full_batch_run(tmp_path_factory, tiny_model_dir, data_files):
    """The reference: one process, micro-batch 8, no accumulation, 48 samples → 6 updates."""
    out = tmp_path_factory.mktemp("full-batch")
    run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, out, per_device_train_batch_size=8, gradient_accumulation_steps=1),
    )
    return out


@pytest.mark.parametrize("micro, accumulation", [(4, 2), (2, 4)])
def test_accumulation_matches_the_full_batch(
    tmp_path, tiny_model_dir, data_files, full_batch_run, micro, accumulation
):
    run_in_process(
        "text_classification",
        tiny_args(
            tiny_model_dir,
            data_files,
            tmp_path,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
        ),
    )
    assert_same_run(tmp_path, full_batch_run)


def test_effective_batch_size_derives_the_accumulation(tmp_path, tiny_model_dir, data_files, full_batch_run):
    results = run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, tmp_path, per_device_train_batch_size=2, effective_batch_size=8),
    )
    assert results["gradient_accumulation_steps"] == 4 and results["effective_batch_size"] == 8
    assert_same_run(tmp_path, full_batch_run)


@pytest.mark.launch
def test_two_ddp_processes_match_one_process_when_the_rows_do_not_divide(tmp_path, tiny_model_dir, data_files):
    """41 rows in windows of 2 micro × 2 accumulation × 2 processes: the last window holds one row,
    so Accelerate pads process 0's micro-batch and gives process 1 only repeated rows. Each
    update, the last included, must be the single-process update of the same rows, also with
    Accelerate's `sync_each_batch` (gradients reduced after every micro-batch, not only the
    window's last; accelerate#2531: under FSDP it saves the window's unsharded gradients).

    The same launch (ft_accum/testing/recipe_runs.py: each process imports everything once) runs
    the gradient-noise hooks under DDP (test_noise_scale.py holds their other tests): 2 processes
    × micro 2 × accumulation 2 and 1 process × micro 2 × accumulation 4 cut each window into the
    same four micro-batches. If the hooks saw DDP's averaged gradient on the sync micro-batch, the
    mean |g_b|² of the two runs would differ."""
    settings = {"max_train_samples": 41, "optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 0}
    noise = {"per_device_train_batch_size": 2, "measure_noise_scale": True, "max_train_steps": 3}
    run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, tmp_path / "one", per_device_train_batch_size=8, **settings),
    )
    run_in_process(  # the one-process runs need no launcher: the launch under test is the DDP one
        "text_classification",
        tiny_args(tiny_model_dir, data_files, tmp_path / "noise_one", gradient_accumulation_steps=4, **noise),
    )
    ddp = {"per_device_train_batch_size": 2, "effective_batch_size": 8, **settings}
    result = launch_runs(
        "text_classification",
        [
            tiny_args(tiny_model_dir, data_files, tmp_path / "ddp", **ddp),
            tiny_args(tiny_model_dir, data_files, tmp_path / "sync_each_batch", sync_each_batch=True, **ddp),
            tiny_args(tiny_model_dir, data_files, tmp_path / "noise_ddp", gradient_accumulation_steps=2, **noise),
            tiny_args(tiny_model_dir, data_files, tmp_path / "eval_ddp", eval_steps=4, **ddp),
            # No accuracy can beat the first evaluation's by 10: patience 1 stops after the second, at update 4.
            tiny_args(
                tiny_model_dir,
                data_files,
                tmp_path / "stop_ddp",
                eval_steps=2,
                early_stopping_patience=1,
                early_stopping_threshold=10,
                **ddp,
            ),  # fmt: skip
        ],
        num_processes=2,
        work_dir=tmp_path,
    )
    assert "2 micro × 2 accumulation × 2 processes = 8 samples per update" in result.stdout
    for run in ("ddp", "sync_each_batch", "noise_ddp", "eval_ddp", "stop_ddp"):
        results = json.loads((tmp_path / run / "all_results.json").read_text())
        assert results["num_processes"] == 2, f"{run}: accelerate launch started one process, not two"
        assert results["distributed_type"] == "MULTI_CPU", results
    for run in ("ddp", "sync_each_batch"):
        assert json.loads((tmp_path / run / "all_results.json").read_text())["gradient_accumulation_steps"] == 2
        assert [m["samples_seen"] for m in read_metrics(tmp_path / run)] == [8, 16, 24, 32, 40, 41]
        assert_same_run(tmp_path / run, tmp_path / "one")
        assert_schedule_ends_at_the_last_update(tmp_path / run)
    # --eval_steps (issue 65): evaluations after update 4 and at the epoch's end only, the same updates as without.
    assert [e["step"] for e in read_evaluations(tmp_path / "eval_ddp")] == [4, 6]
    assert_same_run(tmp_path / "eval_ddp", tmp_path / "one")
    # Early stopping on 2 processes: both stop after update 4 (the launch ended: no process waits for the other).
    stopped = json.loads((tmp_path / "stop_ddp" / "all_results.json").read_text())
    assert [e["step"] for e in read_evaluations(tmp_path / "stop_ddp")] == [2, 4]
    assert stopped["stopped_early_at"] == stopped["num_update_steps"] == 4 and stopped["best_step"] == 2
    assert "early stopping: eval_accuracy has not improved" in result.stdout
    assert re.search(r"^  early stopping +after 1 evaluation", result.stdout, re.M)  # the banner says it is on
    for a, b in zip(read_metrics(tmp_path / "stop_ddp"), read_metrics(tmp_path / "one")[:4], strict=True):
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-5)
    noise_ddp, noise_one = read_metrics(tmp_path / "noise_ddp"), read_metrics(tmp_path / "noise_one")
    assert len(noise_ddp) == len(noise_one) == 3
    for a, b in zip(noise_ddp, noise_one):
        assert a["grad_sq_small"] == pytest.approx(b["grad_sq_small"], rel=1e-5)
        assert a["grad_sq_big"] == pytest.approx(b["grad_sq_big"], rel=1e-5)


def assert_schedule_ends_at_the_last_update(out):
    """Linear decay to 0 over the run: the LR after the last update is 0, and only then."""
    lrs = [m["lr"] for m in read_metrics(out)]
    assert lrs[-1] == 0.0
    assert all(lr > 0 for lr in lrs[:-1]), lrs


def test_schedule_ends_at_the_last_update_one_process(full_batch_run):
    assert len(read_metrics(full_batch_run)) == 6
    assert_schedule_ends_at_the_last_update(full_batch_run)


def test_short_last_window_equals_a_full_batch_update_on_the_leftover(tmp_path, tiny_model_dir, data_files):
    """20 samples in windows of 16: the second update sees 4 leftovers as one micro-batch of a
    window of 4. SGD makes the update linear in the gradient, so a short window divided by N
    (what Accelerate does on its own) would be 4× too small here."""
    train = write_jsonl(tmp_path / "train20.jsonl", make_rows(20, seed=3))
    data = {**data_files, "train": train}
    common = {"optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 0}
    run_in_process(
        "text_classification",
        tiny_args(
            tiny_model_dir,
            data,
            tmp_path / "full",
            per_device_train_batch_size=16,
            gradient_accumulation_steps=1,
            **common,
        ),
    )
    run_in_process(
        "text_classification",
        tiny_args(
            tiny_model_dir,
            data,
            tmp_path / "accum",
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            **common,
        ),
    )
    assert [m["samples_seen"] for m in read_metrics(tmp_path / "accum")] == [16, 20]
    assert_same_run(tmp_path / "accum", tmp_path / "full")


def test_short_window_equals_a_plain_pytorch_full_batch_step(tmp_path, tiny_model_dir, data_files):
    """12 samples with micro 4 × accumulation 4: the only window holds 3 of its 4 micro-batches.
    The reference is independent of the recipe: one plain-PyTorch SGD step on the mean loss of all
    12 samples (a sum, so the sample order does not matter). Without the window correction the
    recipe's step is 3/4 of it."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rows = make_rows(12, seed=5)
    data = {**data_files, "train": write_jsonl(tmp_path / "train12.jsonl", rows)}
    run_in_process(
        "text_classification",
        tiny_args(
            tiny_model_dir,
            data,
            tmp_path / "accum",
            per_device_train_batch_size=4,
            gradient_accumulation_steps=4,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0,
        ),
    )
    assert [m["samples_seen"] for m in read_metrics(tmp_path / "accum")] == [12]

    label_ids = {name: i for i, name in enumerate(sorted({r["label"] for r in rows}))}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    batch = tokenizer([r["text"] for r in rows], padding=True, truncation=True, max_length=48, return_tensors="pt")
    loss = model(**batch, labels=torch.tensor([label_ids[r["label"]] for r in rows])).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad  # SGD's first step: the momentum buffer is the gradient itself
    expected = {k: v.contiguous() for k, v in model.state_dict().items()}
    ours = final_weights(tmp_path / "accum")
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    # Compare the updates w − w0, not the weights: a wrong scale of the step is then an O(1) error
    # (0.25 without the correction) instead of being diluted by the weights' own size.
    ours_step = {k: ours[k] - initial[k] for k in ours}
    expected_step = {k: expected[k] - initial[k] for k in ours}
    assert relative_error(ours_step, expected_step) <= UPDATE_RTOL


def test_outputs_load_with_from_pretrained_and_pipeline(full_batch_run):
    from transformers import AutoModelForSequenceClassification, pipeline

    final = full_batch_run / "final"
    model = AutoModelForSequenceClassification.from_pretrained(final)
    assert set(model.config.id2label.values()) == {"money", "sport", "tech"}
    prediction = pipeline("text-classification", model=str(final))("the team scored a late goal")
    assert prediction[0]["label"] in {"money", "sport", "tech"}

    records = read_metrics(full_batch_run)
    assert set(records[0]) == {
        "step",
        "epoch",
        "loss",
        "lr",
        "grad_norm",
        "samples_seen",
        "tokens_seen",
        "samples_per_second",
        "tokens_per_second",
        "skipped_updates",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "effective_batch_size",
    }
    assert [m["samples_seen"] for m in records] == [8, 16, 24, 32, 40, 48]
    results = json.loads((full_batch_run / "all_results.json").read_text())
    for key in (
        "eval_accuracy",
        "eval_macro_f1",
        "train_runtime",
        "train_samples_per_second",
        "effective_batch_size",
        "learning_rate",
    ):
        assert key in results


def test_sample_order_does_not_depend_on_the_split(tmp_path, tiny_model_dir, data_files):
    """Per-update token counts identify which samples an update saw; they must agree across splits."""
    runs = {}
    for micro, accumulation in [(8, 1), (1, 8)]:
        out = tmp_path / f"{micro}x{accumulation}"
        run_in_process(
            "text_classification",
            tiny_args(
                tiny_model_dir,
                data_files,
                out,
                per_device_train_batch_size=micro,
                gradient_accumulation_steps=accumulation,
                num_train_epochs=2,
                max_train_steps=None,
            ),
        )
        runs[micro] = [m["tokens_seen"] for m in read_metrics(out)]
    assert runs[8] == runs[1]
    increments = [b - a for a, b in zip([0] + runs[8], runs[8])]
    assert len(set(increments)) > 1, "token counts are all equal: the check would not see a reordering"


def test_tensorboard_logs_when_asked(tmp_path, tiny_model_dir, data_files):
    pytest.importorskip("tensorboard")
    run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, tmp_path, report_to="tensorboard", max_train_steps=2),
    )
    assert list(tmp_path.rglob("events.out.tfevents.*")), "no TensorBoard event file written"


@pytest.mark.parametrize("failure", ["cpu_allocator_refusal", "cuda_out_of_memory"])
def test_auto_micro_batch_retries_the_update_with_the_same_effective_batch(
    tmp_path, tiny_model_dir, data_files, monkeypatch, failure
):
    """An allocation fails in the 2nd micro-batch of update 3 whenever the micro-batch exceeds 4.
    The run halves the micro-batch, doubles the accumulation and retries update 3; it must then
    match a run started at micro-batch 4 (same samples per update, same weights)."""
    from transformers import BertForSequenceClassification

    forward, calls = BertForSequenceClassification.forward, {"training": 0}

    def forward_that_runs_out_of_memory(self, input_ids=None, **kwargs):
        if self.training:
            calls["training"] += 1
            if input_ids.shape[0] > 4 and calls["training"] >= 6:
                if failure == "cpu_allocator_refusal":
                    torch.empty(1 << 62, dtype=torch.uint8)  # the CPU allocator really refuses this
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(BertForSequenceClassification, "forward", forward_that_runs_out_of_memory)
    common = {"effective_batch_size": 16, "num_train_epochs": 2}
    auto, reference = tmp_path / "auto", tmp_path / "reference"
    results = run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, auto, per_device_train_batch_size=8, auto_micro_batch=True, **common),
    )
    run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, reference, per_device_train_batch_size=4, **common),
    )

    records = read_metrics(auto)
    assert [(r["per_device_train_batch_size"], r["gradient_accumulation_steps"]) for r in records] == [
        (8, 2),
        (8, 2),
        (4, 4),
        (4, 4),
        (4, 4),
        (4, 4),
    ]
    assert results["effective_batch_size"] == 16 and results["per_device_train_batch_size"] == 4
    assert_same_run(auto, reference)


def test_without_auto_micro_batch_an_out_of_memory_error_propagates(tmp_path, tiny_model_dir, data_files, monkeypatch):
    from transformers import BertForSequenceClassification

    def out_of_memory(self, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(BertForSequenceClassification, "forward", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        run_in_process(
            "text_classification", tiny_args(tiny_model_dir, data_files, tmp_path, per_device_train_batch_size=8)
        )
