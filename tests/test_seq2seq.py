"""recipes/seq2seq.py: target-token-weighted accumulation against the full batch, for a T5-style model
and for an encoder-decoder warm-started from an encoder checkpoint (the offline default's path).

Targets of 1 to 12 words make the target-token count differ from micro-batch to micro-batch.
"""

import json

import pytest
from conftest import (
    ROOT,
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

from ft_accum.data.offline_assets import BBC_TOPICS
from ft_accum.testing import make_text_pairs, make_tiny_t5


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs")
    return {
        "train": write_jsonl(path / "train.jsonl", make_text_pairs(48, seed=1)),
        "validation": write_jsonl(path / "validation.jsonl", make_text_pairs(8, seed=2)),
    }


@pytest.fixture(scope="module")
def tiny_t5_dir(tmp_path_factory, tiny_model_dir):
    return make_tiny_t5(tmp_path_factory.mktemp("tiny-t5"), tiny_model_dir)


def s2s_args(model_dir, data, output_dir, **overrides):
    return recipe_args(model_dir, data, output_dir, **{"max_source_length": 48, "max_target_length": 16, **overrides})


@pytest.mark.parametrize("model", ["t5", "warm-started bert2bert"])
def test_accumulation_matches_the_full_batch_with_varying_target_lengths(
    tmp_path, model, tiny_t5_dir, tiny_model_dir, pair_files
):
    model_dir = tiny_t5_dir if model == "t5" else tiny_model_dir
    results = run_in_process(
        "seq2seq",
        s2s_args(
            model_dir, pair_files, tmp_path / "full", per_device_train_batch_size=8, gradient_accumulation_steps=1
        ),
    )
    run_in_process(
        "seq2seq",
        s2s_args(
            model_dir, pair_files, tmp_path / "accum", per_device_train_batch_size=2, gradient_accumulation_steps=4
        ),
    )
    counts = [
        b["tokens_seen"] - a["tokens_seen"]
        for a, b in zip([{"tokens_seen": 0}] + read_metrics(tmp_path / "full"), read_metrics(tmp_path / "full"))
    ]
    assert len(set(counts)) > 3, f"the target-token count should vary per update: {counts}"
    assert_same_run(tmp_path / "accum", tmp_path / "full")
    assert {"eval_rouge1", "eval_rougeL", "initial_eval_rougeL", "eval_loss"} <= set(results)


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ({"target_column": "summary"}, ["--target_column 'summary' is not a column", "source, target"]),
        ({"max_source_length": 1}, ["--max_source_length must be ≥ 2"]),
        ({"max_source_length": 512}, ["--max_source_length 512 is longer than the model's 64 positions"]),
        ({"bundled_task": "summary"}, ["--bundled_task must be one of topic, headline, got 'summary'"]),
        ({"bundled_task": "headline"}, ["--bundled_task picks the offline data: drop it, or drop"]),
    ],
)
def test_bad_seq2seq_inputs_stop_with_one_line(tmp_path, tiny_model_dir, pair_files, overrides, fragments):
    message = error_of("seq2seq", s2s_args(tiny_model_dir, pair_files, tmp_path, **overrides))
    for fragment in fragments:
        assert fragment in message, message


def test_resume_from_a_copied_checkpoint_is_bit_identical(tmp_path, tiny_t5_dir, pair_files):
    common = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "num_beams": 2}
    run_in_process("seq2seq", s2s_args(tiny_t5_dir, pair_files, tmp_path / "full", checkpointing_steps=3, **common))
    resumed = copy_checkpoint(tmp_path / "full", 3, tmp_path / "resumed")
    run_in_process("seq2seq", s2s_args(tiny_t5_dir, pair_files, resumed, resume_from_checkpoint="latest", **common))
    assert [r["step"] for r in read_metrics(resumed)] == [4, 5, 6]
    assert max_abs_difference(final_weights(resumed), final_weights(tmp_path / "full")) == 0.0


@pytest.mark.launch
def test_two_ddp_processes_match_one_process_when_the_rows_do_not_divide(tmp_path, tiny_t5_dir, pair_files):
    """Real DDP over gloo, on 45 rows that leave the last window short and uneven across the processes: target tokens counted over both processes; generation gathered across them."""
    full = run_in_process(
        "seq2seq",
        s2s_args(
            tiny_t5_dir,
            pair_files,
            tmp_path / "full",
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            max_train_samples=45,
        ),
    )
    launch(
        "seq2seq",
        s2s_args(
            tiny_t5_dir,
            pair_files,
            tmp_path / "ddp",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_train_samples=45,
        ),
        num_processes=2,
    )
    ddp = json.loads((tmp_path / "ddp" / "all_results.json").read_text())
    assert ddp["num_processes"] == 2 and ddp["distributed_type"] == "MULTI_CPU"
    assert_same_run(tmp_path / "ddp", tmp_path / "full")
    assert ddp["eval_rougeL"] == pytest.approx(full["eval_rougeL"], abs=1e-6) and ddp["eval_loss"] == pytest.approx(
        full["eval_loss"], rel=1e-5
    )


def test_every_trainable_parameter_of_a_warm_start_gets_a_gradient(tmp_path, tiny_model_dir):
    """DDP's requirement: a trainable parameter without a gradient (the encoder's pooler, which the
    decoder never reads) makes the second update fail on 2 processes. Checked in-process, for the
    warm start and for the saved encoder-decoder loaded back, as the recipe loads both."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from ft_accum.models.loading import freeze_encoder_pooler, warm_start_encoder_decoder

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    warm = warm_start_encoder_decoder(str(tiny_model_dir), tokenizer)
    warm.save_pretrained(tmp_path / "bert2bert")
    for model in (warm, freeze_encoder_pooler(AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "bert2bert"))):
        batch = tokenizer(["the match ended", "shares fell"], padding=True, return_tensors="pt")
        labels = tokenizer(["match", "shares"], padding=True, return_tensors="pt")["input_ids"]
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss.backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert missing == [], missing


def test_bundled_task_picks_the_offline_data_and_the_card_names_it():
    """No data flags: each article's body → its topic word; --bundled_task headline: the same bodies,
    held out the same way, → their headlines. The model card names the data the run trained on."""
    from types import SimpleNamespace

    from ft_accum.training.model_card import data_description
    from ft_accum.training.recipe_modules import load_recipe_module

    recipe = load_recipe_module(ROOT / "recipes" / "seq2seq.py")
    args = SimpleNamespace(seed=42, max_train_samples=None, max_eval_samples=None)
    topic = recipe.load_raw_data(recipe.TaskArguments(), args)
    headline = recipe.load_raw_data(recipe.TaskArguments(bundled_task="headline"), args)
    for split in ("train", "validation"):
        assert topic[split]["source"] == headline[split]["source"]
    assert sorted(set(topic["validation"]["target"])) == sorted(BBC_TOPICS)
    assert len(set(headline["train"]["target"])) > 0.95 * len(headline["train"])  # one headline per article
    assert "topics" in data_description("seq2seq", {})
    assert "headlines" in data_description("seq2seq", {"bundled_task": "headline"})
