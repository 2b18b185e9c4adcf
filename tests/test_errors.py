"""Bad input gets a one-line error that names the problem and the fix, not a library traceback."""

import pytest
import torch
from conftest import error_of as recipe_error
from conftest import launch, tiny_args


def error_of(args) -> str:
    return recipe_error("text_classification", args)


@pytest.fixture
def args(tiny_model_dir, data_files, tmp_path):
    return lambda **overrides: tiny_args(tiny_model_dir, data_files, tmp_path / "out", **overrides)


def test_missing_model_path(args, tmp_path):
    message = error_of(args(model_name_or_path=tmp_path / "no-such-model"))
    assert "does not exist" in message and "config.json" in message


def test_missing_train_file(args, tmp_path):
    message = error_of(args(train_file=tmp_path / "nope.csv"))
    assert "--train_file" in message and "does not exist" in message


@pytest.mark.parametrize("flag, column", [("text_column", "body"), ("label_column", "topic")])
def test_missing_column_lists_the_columns(args, flag, column):
    message = error_of(args(**{flag: column}))
    assert f"--{flag} '{column}' is not a column" in message and "text, label" in message


def test_effective_batch_not_divisible(args):
    message = error_of(args(per_device_train_batch_size=4, effective_batch_size=10))
    assert "not divisible" in message and "8 or 12" in message


@pytest.mark.parametrize("value", [0, -1])
def test_accumulation_not_positive(args, value):
    assert "--gradient_accumulation_steps must be ≥ 1" in error_of(args(gradient_accumulation_steps=value))


def test_accumulation_and_effective_batch_both_given(args):
    assert "give only one" in error_of(args(gradient_accumulation_steps=2, effective_batch_size=16))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fp16_without_cuda(args, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    message = error_of(args())
    assert "fp16 needs a CUDA GPU" in message and "--mixed_precision no" in message


def test_empty_dataset(args, tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    assert "is empty" in error_of(args(train_file=empty, validation_file=None))


def test_resume_from_a_checkpoint_that_does_not_exist(args, tmp_path):
    message = error_of(args(resume_from_checkpoint=tmp_path / "checkpoints" / "step_000099"))
    assert "does not exist" in message and "'latest'" in message


def test_non_finite_loss_names_the_fix(args):
    message = error_of(args(optim="sgd", learning_rate=1e12, max_grad_norm=0, per_device_train_batch_size=4))
    assert "the training loss became" in message and "lower --learning_rate" in message


def test_unknown_yaml_setting(args, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("learning_rat: 0.1\n")
    message = error_of(["--config", str(config), *args()])
    assert "unknown setting(s) learning_rat" in message


@pytest.mark.launch
def test_error_through_accelerate_launch_is_one_line_from_the_recipe(args):
    result = launch("text_classification", args(label_column="topic"), check=False)
    assert result.returncode != 0
    assert "error: --label_column 'topic' is not a column of the train split" in result.stderr
    # accelerate launch adds its own CalledProcessError traceback; the recipe itself must not.
    assert "text_classification.py\", line" not in result.stderr
