"""recipes/sentence_pair_regression.py, the recipe built from docs/writing_a_recipe.md: its own data
format and metric, and DDP on a row count that leaves the last window short and uneven. The
contract (exact accumulation and resume, one-line errors) is checked by test_recipe_contract.py."""

import json

import pytest
from conftest import assert_same_run, launch, read_metrics, run_in_process, tiny_args, write_jsonl

from ft_accum.testing import make_sentence_pairs


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs")
    return {"train": write_jsonl(path / "train.jsonl", make_sentence_pairs(41, seed=1)),
            "validation": write_jsonl(path / "validation.jsonl", make_sentence_pairs(12, seed=2))}  # fmt: skip


def test_pearson_is_reported_and_the_head_is_a_regression(tmp_path, tiny_model_dir, pair_files):
    results = run_in_process("sentence_pair_regression", tiny_args(tiny_model_dir, pair_files, tmp_path))
    assert -1.0 <= results["eval_pearsonr"] <= 1.0 and results["eval_loss"] > 0
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["problem_type"] == "regression" and len(config["id2label"]) == 1


def test_a_missing_pair_column_is_one_line(tmp_path, tiny_model_dir, pair_files):
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(
            "sentence_pair_regression", tiny_args(tiny_model_dir, pair_files, tmp_path, text_pair_column="nope")
        )
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and "nope" in message and "\n" not in message, message


@pytest.mark.launch
def test_two_ddp_processes_match_one_process_when_the_rows_do_not_divide(tmp_path, tiny_model_dir, pair_files):
    """41 pairs in windows of 2 micro × 2 accumulation × 2 processes: process 1 holds only repeats in the last."""
    settings = {"optim": "sgd", "learning_rate": 0.05, "max_grad_norm": 0}
    run_in_process("sentence_pair_regression",
                   tiny_args(tiny_model_dir, pair_files, tmp_path / "one", per_device_train_batch_size=8, **settings))  # fmt: skip
    launch("sentence_pair_regression", tiny_args(tiny_model_dir, pair_files, tmp_path / "ddp",
           per_device_train_batch_size=2, gradient_accumulation_steps=2, **settings), num_processes=2)  # fmt: skip
    assert json.loads((tmp_path / "ddp" / "all_results.json").read_text())["num_processes"] == 2
    assert [m["samples_seen"] for m in read_metrics(tmp_path / "ddp")] == [8, 16, 24, 32, 40, 41]
    assert_same_run(tmp_path / "ddp", tmp_path / "one")
