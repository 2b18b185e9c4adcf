"""recipes/token_classification.py: label-token-weighted accumulation against the full batch, end to end.

The tiny BERT's vocabulary gains "##s", so plural words split into two sub-tokens and the label
alignment (first sub-token only, or all of them) matters. Sentences of 3 to 30 words with about
half of them tagged make the labelled-token count differ from micro-batch to micro-batch.
"""

import json

import pytest
from conftest import (
    COMMON,
    TOPICS,
    assert_same_run,
    copy_checkpoint,
    error_of,
    final_weights,
    launch,
    max_abs_difference,
    read_metrics,
    recipe_args,
    run_in_process,
    write_jsonl,
)

from ft_accum.testing import make_tagged_rows, make_tiny_tagger


@pytest.fixture(scope="module")
def tiny_tagger_dir(tmp_path_factory):
    return make_tiny_tagger(tmp_path_factory.mktemp("tiny-bert-tagger"))


@pytest.fixture(scope="module")
def tag_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("tag-data")
    return {
        "train": write_jsonl(path / "train.jsonl", make_tagged_rows(48, seed=1)),
        "validation": write_jsonl(path / "validation.jsonl", make_tagged_rows(12, seed=2)),
    }


def tagger_args(model_dir, data, output_dir, **overrides):
    return recipe_args(model_dir, data, output_dir, **{"max_seq_length": 64, **overrides})


def test_accumulation_matches_the_full_batch_with_varying_labelled_tokens(tmp_path, tiny_tagger_dir, tag_files):
    run_in_process(
        "token_classification",
        tagger_args(
            tiny_tagger_dir, tag_files, tmp_path / "full", per_device_train_batch_size=8, gradient_accumulation_steps=1
        ),
    )
    run_in_process(
        "token_classification",
        tagger_args(
            tiny_tagger_dir,
            tag_files,
            tmp_path / "accum",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
        ),
    )
    counts = [
        b["tokens_seen"] - a["tokens_seen"]
        for a, b in zip([{"tokens_seen": 0}] + read_metrics(tmp_path / "full"), read_metrics(tmp_path / "full"))
    ]
    assert len(set(counts)) > 3, f"the labelled-token count should vary per update: {counts}"
    assert_same_run(tmp_path / "accum", tmp_path / "full")


def test_only_first_sub_tokens_are_labelled_unless_asked(tmp_path, tiny_tagger_dir, tag_files):
    rows = [json.loads(line) for line in tag_files["train"].read_text().splitlines()]
    words = sum(len(r["tokens"]) for r in rows)
    plurals = sum(
        w.endswith("s") and w[:-1] in {x for ws in TOPICS.values() for x in ws} | set(COMMON)
        for r in rows
        for w in r["tokens"]
    )
    first = run_in_process(
        "token_classification",
        tagger_args(
            tiny_tagger_dir,
            tag_files,
            tmp_path / "first",
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
        ),
    )
    run_in_process(
        "token_classification",
        tagger_args(
            tiny_tagger_dir,
            tag_files,
            tmp_path / "all",
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            label_all_tokens=True,
        ),
    )
    assert read_metrics(tmp_path / "first")[-1]["tokens_seen"] == words
    assert read_metrics(tmp_path / "all")[-1]["tokens_seen"] == words + plurals > words
    assert {"eval_f1", "eval_precision", "eval_recall", "eval_f1_SPORT", "eval_f1_MONEY"} <= set(first)


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ({"label_column": "ner"}, ["--label_column 'ner' is not a column", "tokens, ner_tags"]),
        ({"tokens_column": "words"}, ["--tokens_column 'words' is not a column"]),
        (
            {"_validation": [{"tokens": ["goal"], "ner_tags": ["B-PERSON"]}]},
            ["tag(s) B-PERSON that the train split never shows"],
        ),
        (
            {"_validation": [{"tokens": ["goal", "match"], "ner_tags": ["O"]}]},
            ["row 0 of the validation split has 2 words and 1 tags"],
        ),
    ],
)
def test_bad_tagging_inputs_stop_with_one_line(tmp_path, tiny_tagger_dir, tag_files, overrides, fragments):
    data = dict(tag_files)
    if "_validation" in overrides:
        data["validation"] = write_jsonl(tmp_path / "bad.jsonl", overrides.pop("_validation"))
    message = error_of("token_classification", tagger_args(tiny_tagger_dir, data, tmp_path / "out", **overrides))
    for fragment in fragments:
        assert fragment in message, message


def test_resume_from_a_copied_checkpoint_is_bit_identical(tmp_path, tiny_tagger_dir, tag_files):
    common = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}
    run_in_process(
        "token_classification",
        tagger_args(tiny_tagger_dir, tag_files, tmp_path / "full", checkpointing_steps=3, **common),
    )
    resumed = copy_checkpoint(tmp_path / "full", 3, tmp_path / "resumed")
    run_in_process(
        "token_classification",
        tagger_args(tiny_tagger_dir, tag_files, resumed, resume_from_checkpoint="latest", **common),
    )
    assert [r["step"] for r in read_metrics(resumed)] == [4, 5, 6]
    assert max_abs_difference(final_weights(resumed), final_weights(tmp_path / "full")) == 0.0


def test_an_adaptive_schedule_runs_in_a_token_weighted_recipe(tmp_path, tiny_tagger_dir, tag_files):
    """The noise scale is measured in labelled tokens and converted to sequences for the schedule;
    with a tiny factor the batch doubles every 2 updates and the run still ends with the data."""
    run_in_process(
        "token_classification",
        tagger_args(
            tiny_tagger_dir,
            tag_files,
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            accumulation_schedule="adaptive:max=16,factor=0.01,patience=2",
        ),
    )
    records = read_metrics(tmp_path)
    assert [r["effective_batch_size"] for r in records][:4] == [4, 4, 8, 8] and records[-1]["samples_seen"] == 48
    assert all("noise_scale" in r for r in records)


@pytest.mark.launch
def test_two_ddp_processes_match_one_process_when_the_rows_do_not_divide(tmp_path, tiny_tagger_dir, tag_files):
    """Real DDP over gloo, on 43 rows that leave the last window short and uneven across the processes: the window's labelled tokens are counted over both processes, and the
    evaluation pads and gathers predictions of different lengths across them."""
    full = run_in_process(
        "token_classification",
        tagger_args(
            tiny_tagger_dir,
            tag_files,
            tmp_path / "full",
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            max_train_samples=43,
        ),
    )
    launch(
        "token_classification",
        tagger_args(
            tiny_tagger_dir,
            tag_files,
            tmp_path / "ddp",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_train_samples=43,
        ),
        num_processes=2,
    )
    ddp = json.loads((tmp_path / "ddp" / "all_results.json").read_text())
    assert ddp["num_processes"] == 2 and ddp["distributed_type"] == "MULTI_CPU"
    assert_same_run(tmp_path / "ddp", tmp_path / "full")
    assert ddp["eval_f1"] == pytest.approx(full["eval_f1"], abs=1e-6) and ddp["eval_loss"] == pytest.approx(
        full["eval_loss"], rel=1e-5
    )
