"""A catalogue of bad inputs, across both recipes.

Each case starts from a copy of a real earlier run (two complete checkpoints, final/, metrics) in
--output_dir and asserts three things:
- the run stops with a non-zero exit (SystemExit with a message, not 0 or None);
- the message is one line, starts with `error: `, and names the problem and the fix;
- nothing already saved changed: every file under checkpoints/ and final/ has its old sha256,
  and no half-written `.tmp-*` folder is left.

Cases resume from that run by default, so they get past the output-dir guard to the check they
are about; the guard's own cases set `resume_from_checkpoint=None`.
"""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    error_of,
    make_rows,
    run_in_process,
    snapshot,
    tiny_args,
    tiny_lm_args,
)
from safetensors.torch import load_file

from ft_accum.core.integrity import sha256_of
from ft_accum.training import checkpointing

COMMON = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "checkpointing_steps": 1}


@pytest.fixture(scope="session")
def previous_runs(tmp_path_factory, tiny_model_dir, data_files, tiny_gpt2_dir, lm_data_files):
    """One finished 2-update run per recipe, checkpointed after each update."""
    root = tmp_path_factory.mktemp("previous-runs")
    run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data_files, root / "text_classification", max_train_steps=2, **COMMON),
    )
    run_in_process(
        "causal_lm", tiny_lm_args(tiny_gpt2_dir, lm_data_files, root / "causal_lm", max_train_steps=2, **COMMON)
    )
    return root


def folder_with_tokenizer(path: Path, model_dir: Path) -> Path:
    """`path` with a copy of `model_dir`'s tokenizer files (and no model yet)."""
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny BERT's tokenizer with a wider model: a checkpoint of one cannot load into the other."""
    from transformers import BertConfig, BertForSequenceClassification

    path = folder_with_tokenizer(tmp_path_factory.mktemp("other-bert"), tiny_model_dir)
    config = BertConfig.from_pretrained(tiny_model_dir)
    config.hidden_size, config.intermediate_size = 48, 96
    BertForSequenceClassification(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def remote_code_model_dir(tmp_path_factory, tiny_model_dir):
    """A model whose config asks for its own Python module, which would leave a marker file if imported."""
    path = folder_with_tokenizer(tmp_path_factory.mktemp("remote-code-model"), tiny_model_dir)
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "sneaky",
                "auto_map": {
                    "AutoConfig": "sneaky.SneakyConfig",
                    "AutoModelForSequenceClassification": "sneaky.SneakyModel",
                },
            }
        )
    )
    (path / "sneaky.py").write_text(f"import pathlib\npathlib.Path({str(path / 'RAN')!r}).write_text('code ran')\n")
    return path


def model_without_tokenizer(path: Path, model_dir: Path) -> Path:
    """Only config.json and the weights, as a user who copies two files gets: transformers then builds
    a 5-token tokenizer that maps every word to [UNK] (issue 19)."""
    path.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, path / name)
    return path


def bad_files(folder: Path) -> dict[str, Path]:
    """Data files that are wrong in one way each."""
    rows = make_rows(12, seed=3)
    files = {
        "csv_quoting": 'text,label\n"an unterminated quote,sport\nplain,tech\n',
        "jsonl_invalid": '{"text": "fine", "label": "sport"}\n{"text": "cut off", "label": \n',
        "jsonl_mixed_labels": "".join(
            json.dumps({"text": r["text"], "label": i if i % 2 else r["label"]}) + "\n" for i, r in enumerate(rows)
        ),
        "csv_empty_texts": "text,label\n" + "".join(f",{r['label']}\n" for r in rows),
        "csv_extra_fields": "text,label\n"
        + "".join(f"{r['text']},{r['label']},{i},0.5\n" for i, r in enumerate(rows)),
        "jsonl_int_labels": "".join(
            json.dumps({"text": r["text"], "label": i % 3}) + "\n" for i, r in enumerate(rows)
        ),
        "jsonl_unseen_label": "".join(json.dumps({"text": r["text"], "label": "weather"}) + "\n" for r in rows),
        "jsonl_one_word": "".join(json.dumps({"text": "goal"}) + "\n" for _ in rows),
        "jsonl_one_class": "".join(json.dumps({"text": r["text"], "label": "sport"}) + "\n" for r in rows),
        "jsonl_list_line": "".join(json.dumps(r) + "\n" for r in rows[:2]) + "[1, 2]\n" + json.dumps(rows[3]) + "\n",
        "jsonl_no_label": "".join(json.dumps({"text": r["text"], "topic": r["label"]}) + "\n" for r in rows),
    }
    paths = {}
    for name, text in files.items():
        paths[name] = folder / (name + (".csv" if name.startswith("csv") else ".jsonl"))
        paths[name].write_text(text)
    paths["csv_latin1"] = folder / "latin1.csv"
    paths["csv_latin1"].write_bytes("text,label\ncafé au lait à gogo,money\nthé,tech\n".encode("latin-1"))
    return paths


# (recipe, overrides, substrings the message must hold). Overrides are built from a context with
# the bad files and model folders, and may set a key to None to drop the flag.
CASES = {
    "model path does not exist": (
        "text_classification",
        lambda c: {"model_name_or_path": c["tmp"] / "no-such-model"},
        ["does not exist", "config.json"],
    ),
    "train file does not exist": (
        "text_classification",
        lambda c: {"train_file": c["tmp"] / "nope.jsonl"},
        ["--train_file", "does not exist"],
    ),
    "train file is a folder": (
        "causal_lm",
        lambda c: {"train_file": c["tmp"]},
        ["is a folder", "data file inside it"],
    ),
    "csv with broken quoting": (
        "text_classification",
        lambda c: {"train_file": c["files"]["csv_quoting"], "validation_file": None},
        ["EOF inside string", "check the quoting"],
    ),
    "invalid json line": (
        "text_classification",
        lambda c: {"train_file": c["files"]["jsonl_invalid"], "validation_file": None},
        ["as jsonl", "one JSON object"],
    ),
    "csv not in utf-8": (
        "text_classification",
        lambda c: {"train_file": c["files"]["csv_latin1"], "validation_file": None},
        ["not UTF-8", "re-save it as UTF-8"],
    ),
    "csv rows with extra fields": (
        "text_classification",
        lambda c: {"train_file": c["files"]["csv_extra_fields"], "validation_file": None},
        ["not text", "as many fields as the header"],
    ),
    "empty after dropping blank texts": (
        "text_classification",
        lambda c: {"train_file": c["files"]["csv_empty_texts"], "validation_file": None},
        ["empty after dropping", "empty text or label"],
    ),
    "empty after dropping 1-token documents": (
        "causal_lm",
        lambda c: {"train_file": c["files"]["jsonl_one_word"], "validation_file": None},
        ["no sequences of ≥ 2 tokens", "add data"],
    ),
    "missing text column": (
        "text_classification",
        lambda c: {"text_column": "body"},
        ["--text_column 'body' is not a column", "text, label"],
    ),
    "missing label column": (
        "text_classification",
        lambda c: {"label_column": "topic"},
        ["--label_column 'topic' is not a column", "text, label"],
    ),
    "missing text column (LM)": (
        "causal_lm",
        lambda c: {"text_column": "body"},
        ["--text_column 'body' is not a column"],
    ),
    "labels mix strings and ints": (
        "text_classification",
        lambda c: {"train_file": c["files"]["jsonl_mixed_labels"], "validation_file": None},
        ["mixes int and str", "the same way"],
    ),
    "int labels in train, names in validation": (
        "text_classification",
        lambda c: {"train_file": c["files"]["jsonl_int_labels"]},
        ["holds different kinds of value per split", "the same way in every file"],
    ),
    # Issue 19: the silent failures, and input that reached code we don't own.
    "a single class in the train split": (
        "text_classification",
        lambda c: {"train_file": c["files"]["jsonl_one_class"], "validation_file": None},
        ["a single class in the train split ('sport')", "at least two classes"],
    ),
    "a model folder without tokenizer files": (
        "text_classification",
        lambda c: {"model_name_or_path": c["bare_model"]},
        ["unknown token", "holds no tokenizer files", "tokenizer.json"],
    ),
    "a jsonl line that is not an object": (
        "text_classification",
        lambda c: {"train_file": c["files"]["jsonl_list_line"], "validation_file": None},
        ["jsonl_list_line.jsonl", "line 3 is a JSON list, not an object"],
    ),
    "train and validation files of different formats": (
        "text_classification",
        lambda c: {"validation_file": c["files"]["csv_extra_fields"]},
        ["are of different formats", "give both as jsonl"],
    ),
    "a validation file without the label column": (
        "text_classification",
        lambda c: {"validation_file": c["files"]["jsonl_no_label"]},
        ["--label_column 'label' is not a column of the validation split", "its columns are text, topic"],
    ),
    "negative learning rate": (
        "text_classification",
        lambda c: {"learning_rate": -1e-4},
        ["--learning_rate must be > 0"],
    ),
    "zero learning rate (LM)": ("causal_lm", lambda c: {"learning_rate": 0}, ["--learning_rate must be > 0, got 0.0"]),
    "NaN learning rate": (
        "text_classification",
        lambda c: {"learning_rate": "nan"},
        ["--learning_rate must be a finite"],
    ),
    "infinite learning rate (LM)": (
        "causal_lm",
        lambda c: {"learning_rate": "inf"},
        ["--learning_rate must be a finite"],
    ),
    "resume from a file, not a checkpoint folder": (
        "text_classification",
        lambda c: {"resume_from_checkpoint": c["out"] / "checkpoints" / "step_000002" / "training_state.json"},
        ["is a file", "pass its checkpoint folder", "step_000002"],
    ),
    "an unknown flag": (
        "causal_lm",
        lambda c: {"learning_rat": 1e-4},
        ["unknown argument(s) --learning_rat", "--help"],
    ),
    "a flag value of the wrong type": (
        "text_classification",
        lambda c: {"per_device_train_batch_size": 4.5},
        ["--per_device_train_batch_size", "invalid int value: '4.5'"],
    ),
    "validation label the train split lacks": (
        "text_classification",
        lambda c: {"validation_file": c["files"]["jsonl_unseen_label"]},
        ["label(s) weather", "never shows"],
    ),
    "max_seq_length 0": (
        "text_classification",
        lambda c: {"max_seq_length": 0},
        ["--max_seq_length must be ≥ 2, got 0"],
    ),
    "max_seq_length beyond the model": (
        "text_classification",
        lambda c: {"max_seq_length": 512},
        ["longer than the model's 64 positions", "--max_seq_length 64"],
    ),
    "block_size beyond the context (LM)": (
        "causal_lm",
        lambda c: {"block_size": 128},
        ["--block_size 128 is longer than the model's 64 positions", "--block_size 64"],
    ),
    "zero micro-batch": (
        "text_classification",
        lambda c: {"per_device_train_batch_size": 0},
        ["--per_device_train_batch_size must be ≥ 1, got 0"],
    ),
    "negative micro-batch (LM)": (
        "causal_lm",
        lambda c: {"per_device_train_batch_size": -2},
        ["--per_device_train_batch_size must be ≥ 1, got -2"],
    ),
    "zero accumulation": (
        "text_classification",
        lambda c: {"gradient_accumulation_steps": 0},
        ["--gradient_accumulation_steps must be ≥ 1"],
    ),
    "negative effective batch": (
        "text_classification",
        lambda c: {"gradient_accumulation_steps": None, "effective_batch_size": -8},
        ["--effective_batch_size must be ≥ 1"],
    ),
    "indivisible effective batch": (
        "text_classification",
        lambda c: {"gradient_accumulation_steps": None, "effective_batch_size": 10},
        ["not divisible", "8 or 12"],
    ),
    "accumulation and effective batch both": ("causal_lm", lambda c: {"effective_batch_size": 16}, ["give only one"]),
    "unknown lr_scaling": (
        "text_classification",
        lambda c: {"lr_scaling": "cubic"},
        ["--lr_scaling must be one of", "'cubic'"],
    ),
    "unknown lr_scaling (LM)": ("causal_lm", lambda c: {"lr_scaling": "cubic"}, ["--lr_scaling must be one of"]),
    "checkpoint from a different model": (
        "text_classification",
        lambda c: {"model_name_or_path": c["other_model"]},
        ["saved from a different model", "same --model_name_or_path"],
    ),
    "resume with a changed effective batch": (
        "text_classification",
        lambda c: {"gradient_accumulation_steps": 4},
        ["effective_batch_size 8, this run has 16", "--effective_batch_size 8"],
    ),
    "resume with a changed seed (LM)": ("causal_lm", lambda c: {"seed": 8}, ["seed 7, this run has 8", "--seed 7"]),
    "resume with another optimizer": (
        "text_classification",
        lambda c: {"optim": "sgd"},
        ["optim adamw_torch, this run has sgd", "--optim adamw_torch"],
    ),
    "resume from a checkpoint that does not exist": (
        "text_classification",
        lambda c: {"resume_from_checkpoint": c["out"] / "checkpoints" / "step_000099"},
        ["does not exist", "'latest'"],
    ),
    "output_dir holds a finished run": (
        "text_classification",
        lambda c: {"resume_from_checkpoint": None},
        ["already holds a finished run", "--overwrite_output_dir"],
    ),
    "output_dir holds an unfinished run (LM)": (
        "causal_lm",
        lambda c: {"resume_from_checkpoint": None, "_remove": "all_results.json"},
        ["checkpoints of an unfinished run", "--resume_from_checkpoint latest"],
    ),
    "overwrite and resume together": (
        "text_classification",
        lambda c: {"overwrite_output_dir": True},
        ["contradict each other"],
    ),
    "output_dir under a file": (
        "text_classification",
        lambda c: {"output_dir": c["files"]["csv_quoting"] / "run", "resume_from_checkpoint": None},
        ["cannot write to --output_dir", "a folder you can write to"],
    ),
    # Refused at the evaluation before training, not after the training up to the first one.
    "unknown metric_for_best_model": (
        "text_classification",
        lambda c: {"metric_for_best_model": "eval_bleu"},
        ["--metric_for_best_model eval_bleu is not a metric of this recipe's evaluation", "eval_accuracy"],
    ),
    "model that needs its own code": (
        "text_classification",
        lambda c: {"model_name_or_path": c["remote_model"]},
        ["contains custom code", "--trust_remote_code only if you trust"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(
    name,
    tmp_path,
    previous_runs,
    tiny_model_dir,
    data_files,
    tiny_gpt2_dir,
    lm_data_files,
    other_model_dir,
    remote_code_model_dir,
):
    recipe, overrides, expected = CASES[name]
    out = tmp_path / "out"
    shutil.copytree(previous_runs / recipe, out)
    context = {
        "tmp": tmp_path,
        "out": out,
        "files": bad_files(tmp_path),
        "other_model": other_model_dir,
        "remote_model": remote_code_model_dir,
        "bare_model": model_without_tokenizer(tmp_path / "bare-model", tiny_model_dir),
    }
    settings = {**COMMON, "resume_from_checkpoint": "latest", **overrides(context)}
    if removed := settings.pop("_remove", None):
        (out / removed).unlink()
    saved = {folder: snapshot(out / folder) for folder in ("checkpoints", "final")}
    output_dir = settings.pop("output_dir", out)
    args = (
        tiny_args(tiny_model_dir, data_files, output_dir, **settings)
        if recipe == "text_classification"
        else tiny_lm_args(tiny_gpt2_dir, lm_data_files, output_dir, **settings)
    )

    message = error_of(recipe, args)  # asserts SystemExit with one line starting "error: "

    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    for folder, before in saved.items():
        assert snapshot(out / folder) == before, f"{folder}/ changed"
    assert not list(out.rglob(".tmp-*")), "a half-written folder was left behind"
    assert not (remote_code_model_dir / "RAN").exists(), "the model's own code ran without --trust_remote_code"


@pytest.mark.parametrize("recipe", ["text_classification", "causal_lm"])
def test_non_finite_loss_stops_before_the_update_and_names_where(
    recipe, tmp_path, tiny_model_dir, data_files, tiny_gpt2_dir, lm_data_files
):
    settings = {**COMMON, "optim": "sgd", "learning_rate": 1e12, "max_grad_norm": 0}
    args = (
        tiny_args(tiny_model_dir, data_files, tmp_path, **settings)
        if recipe == "text_classification"
        else tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path, **settings)
    )
    message = error_of(recipe, args)
    assert "the training loss became" in message and "Lower --learning_rate" in message
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = checkpointing.latest_checkpoint(tmp_path)
    assert last is not None and last.name == checkpointing.checkpoint_name(steps[-1]), (
        "the test needs a checkpoint before the bad update"
    )
    assert f"at update {steps[-1] + 1}, micro-batch " in message and f"nothing was saved after {last}" in message
    # Every checkpoint that was written holds finite weights, and none exists past the bad update.
    for checkpoint in checkpointing.list_checkpoints(tmp_path):
        weights = load_file(str(checkpoint / "model.safetensors"))
        assert all(torch.isfinite(w).all() for w in weights.values()), f"{checkpoint} holds non-finite weights"
    assert not (tmp_path / "final").exists()


def test_unknown_yaml_setting(tmp_path, tiny_model_dir, data_files):
    config = tmp_path / "bad.yaml"
    config.write_text("learning_rat: 0.1\n")
    message = error_of(
        "text_classification", ["--config", str(config), *tiny_args(tiny_model_dir, data_files, tmp_path / "out")]
    )
    assert "unknown setting(s) learning_rat" in message and "valid:" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fp16_without_cuda(tmp_path, tiny_model_dir, data_files, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    message = error_of("text_classification", tiny_args(tiny_model_dir, data_files, tmp_path / "out"))
    assert "fp16 needs a CUDA GPU" in message and "--mixed_precision no" in message


def test_a_checkpoint_with_pickled_code_is_refused_without_running_it(
    tmp_path, previous_runs, tiny_model_dir, data_files
):
    """A checkpoint file that unpickles into code is rejected by torch.load(weights_only=True), even with a matching manifest."""
    out = tmp_path / "out"
    shutil.copytree(previous_runs / "text_classification", out)
    marker = tmp_path / "RAN"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    checkpoint = out / "checkpoints" / "step_000002"
    with open(checkpoint / "scheduler.bin", "wb") as f:
        pickle.dump(Payload(), f)
    state = checkpointing.load_training_state(checkpoint)  # forge the manifest, as an attacker would
    state["manifest"]["scheduler.bin"] = {
        "size": (checkpoint / "scheduler.bin").stat().st_size,
        "sha256": sha256_of(checkpoint / "scheduler.bin"),
    }
    (checkpoint / checkpointing.STATE_FILE).write_text(json.dumps(state))

    message = error_of(
        "text_classification", tiny_args(tiny_model_dir, data_files, out, resume_from_checkpoint="latest", **COMMON)
    )
    assert "not plain tensors" in message and "weights_only=True" in message
    assert not marker.exists(), "unpickling ran the payload"


def test_overwrite_output_dir_replaces_a_finished_run(tmp_path, previous_runs, tiny_model_dir, data_files):
    out = tmp_path / "out"
    shutil.copytree(previous_runs / "text_classification", out)
    run_in_process(
        "text_classification",
        tiny_args(
            tiny_model_dir,
            data_files,
            out,
            max_train_steps=1,
            overwrite_output_dir=True,
            **{**COMMON, "checkpointing_steps": None},
        ),
    )
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not (out / "checkpoints").exists(), "the old run's checkpoints were kept beside the new run"
