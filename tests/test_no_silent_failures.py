"""Issue 19: every error a user can cause ends as one `error:` line with the fix, never a traceback
and never a run that "succeeds" with meaningless numbers; and one run per output folder.

- Property tests: every field of every recipe's two argument dataclasses gets values of the wrong
  type, out of range and non-finite, on the command line and in a YAML --config. Each must be
  refused at parse time, in one line.
- The same for the `ft-accum` commands.
- The output-folder lock: a second run refuses with the holder's PID; `kill -9` of the holder frees it.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import typing

import pytest
import yaml
from conftest import ROOT, load_recipe, read_metrics, run_in_process, tiny_args

from ft_accum.cli import main as cli
from ft_accum.training.arguments import TrainingArguments, parse_args, run_main

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
# The shared arguments' free-form text (paths, a schedule): any string is valid until it is used, and
# those uses have their own tests (test_bad_inputs.py). A recipe's own text fields (column names,
# prompts, choices) get the YAML type check only, so a new recipe needs no entry here; its choices are
# checked by its own tests.
# metric_for_best_model: a metric's name, checked against the evaluation's metrics before training.
SHARED_FREE_TEXT = {"output_dir", "resume_from_checkpoint", "accumulation_schedule", "metric_for_best_model"}


def base_type(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def bad_values(kind):
    """(CLI text, YAML value) pairs that are wrong for a field of type `kind`."""
    if kind is bool:
        return [("maybe", "maybe"), ("2", 2)]
    if kind is int:
        return [("abc", "abc"), ("4.5", 4.5), ("-1", -1), ("nan", float("nan"))]
    if kind is float:
        return [("abc", "abc"), ("nan", float("nan")), ("inf", float("inf")), ("-1", -1), ("-inf", float("-inf"))]
    return [("bogus-value", 123)]  # str: an unknown choice, or a number where text belongs


def cases():
    """The shared TrainingArguments fields once (they are parsed by the same code in every recipe,
    ft_accum/training/arguments.py), and each recipe's own task fields for that recipe."""
    shared = typing.get_type_hints(TrainingArguments)
    for recipe in RECIPES:
        fields = typing.get_type_hints(load_recipe(recipe).TaskArguments)
        if recipe == RECIPES[0]:
            fields = {**fields, **shared}
        for name, hint in sorted(fields.items()):
            kind = base_type(hint)
            free_text = name in SHARED_FREE_TEXT or name not in shared
            for cli_text, yaml_value in bad_values(kind):
                if free_text and kind is str:
                    yield pytest.param(recipe, name, None, yaml_value, id=f"{recipe}-{name}-yaml-{yaml_value!r}")
                    continue
                yield pytest.param(recipe, name, cli_text, yaml_value, id=f"{recipe}-{name}-{cli_text}")


def one_line_error(recipe, argv):
    module = load_recipe(recipe)
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda task, args: pytest.fail(f"{argv} was accepted"), module.TaskArguments, argv, None)
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and "\n" not in message and "Traceback" not in message, message
    return message


@pytest.mark.parametrize("recipe, name, cli_text, yaml_value", list(cases()))
def test_every_config_field_refuses_bad_values_in_one_line(recipe, name, cli_text, yaml_value, tmp_path):
    if cli_text is not None:
        message = one_line_error(recipe, [f"--{name}={cli_text}"])
        assert name in message, message
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({name: yaml_value}))
    message = one_line_error(recipe, ["--config", str(config)])
    assert name in message, message


def test_the_shipped_configs_still_parse():
    for recipe in RECIPES:
        task, args = parse_args(
            load_recipe(recipe).TaskArguments, ["--config", str(ROOT / "recipes" / "configs" / f"{recipe}.yaml")]
        )
        assert dataclasses.is_dataclass(task) and args.learning_rate > 0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("per_device_train_batch_size: 4.5\n", "must be a whole number, got 4.5"),
        ("learning_rate: [1, 2]\n", "must be a number"),
        ("accumulation_schedule: 100:30\n", "quote it"),  # YAML 1.1 reads 100:30 as the number 6030
        ("per_device_train_batch_size: 4\n  learning_rate: 1\n", "not valid YAML at line 2"),
        ("- a list\n", "must hold a mapping"),
    ],
)
def test_yaml_mistakes_are_one_line(tmp_path, text, expected):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    assert expected in one_line_error("text_classification", ["--config", str(config)])


def test_yaml_numbers_written_without_a_dot_are_read_as_numbers(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("learning_rate: 3e-4\n")  # YAML 1.1 reads this as the string "3e-4"
    _, args = parse_args(load_recipe("text_classification").TaskArguments, ["--config", str(config)])
    assert args.learning_rate == 3e-4


def cli_error(argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["plan", "--seq_len", "abc"], "invalid int value: 'abc'"),
        (["plan", "--seq_len", "-1"], "--seq_len must be ≥ 1"),
        (["plan", "--effective_batch_size", "0"], "--effective_batch_size must be ≥ 1"),
        (["plan", "--num_processes", "nan"], "invalid int value"),
        (["plan", "--gpu_memory", "lots"], "is not a size"),
        (["plan", "--gpu_memory", "nan"], "--gpu_memory"),
        (["plan", "--precision", "fp64"], "invalid choice"),
        (["plan", "--lora_r", "-4"], "--lora_r must be ≥ 1"),
        (["plan", "--seq_len", "4096", "--model", "gpt2-124m"], "longer than the model's 1024 positions"),
        (["plan", "--seq_len", "512", "--unknown_flag"], "unrecognized arguments"),
        (["sweep", "/no/such/sweep.yaml"], "does not exist"),
        (["report", "/no/such/run"], "holds no metrics.jsonl"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_cli_bad_input_is_one_line(argv, expected):
    assert expected in cli_error(argv)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"model_type": "gpt2", "n_embd"', "is not valid JSON"),
        ('{"model_type": "no_such_model"}', "does not know model_type"),
    ],
)
def test_plan_config_that_is_truncated_or_unknown(tmp_path, text, expected):
    config = tmp_path / "config.json"
    config.write_text(text)
    assert expected in cli_error(["plan", "--config", str(config)])


def test_plan_refuses_a_length_the_recipes_refuse():
    """Silent failure 3: it recommended a split for GPT-2 at 4,096 tokens, which has 1,024 positions."""
    assert "--seq_len 1024 or less" in cli_error(["plan", "--model", "gpt2-124m", "--seq_len", "4096"])


def test_report_skips_a_last_line_cut_by_a_kill(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        json.dumps({"step": i, "loss": 1.0 / i, "lr": 1e-3, "grad_norm": 1.0, "samples_seen": 8 * i}) for i in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 3, "lo')
    assert cli.main(["report", str(run), "--out", str(tmp_path / "report")]) in (0, None)
    assert "line 3 is cut off" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text(lines[0] + "\n{broken\n" + lines[1] + "\n")
    assert "line 2 is not a JSON object" in cli_error(["report", str(run)])


def test_a_validation_file_with_extra_columns_is_fine(tmp_path, tiny_model_dir, data_files):
    extra = tmp_path / "validation.jsonl"
    rows = [json.loads(line) for line in data_files["validation"].read_text().splitlines()]
    extra.write_text("".join(json.dumps({**r, "source": "wire", "id": i}) + "\n" for i, r in enumerate(rows)))
    results = run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, {**data_files, "validation": extra}, tmp_path / "out", max_train_steps=1),
    )
    assert results["num_update_steps"] == 1


def slow_args(tiny_model_dir, data_files, out, **overrides):
    settings = {"per_device_train_batch_size": 4, "effective_batch_size": 8, "max_train_steps": 400,
                "num_train_epochs": 1000, "checkpointing_steps": 2, **overrides}  # fmt: skip
    return tiny_args(tiny_model_dir, data_files, out, **settings)


def start_holder(args, log):
    return subprocess.Popen([sys.executable, str(ROOT / "recipes" / "text_classification.py"), *args], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def wait_for(condition, process, seconds=300):
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None and time.monotonic() < deadline, "the first run ended too early"
        time.sleep(0.05)


@pytest.mark.launch
def test_one_run_per_output_folder_and_ctrl_c_saves_and_frees_it(tmp_path, tiny_model_dir, data_files):
    """Silent failure 4: two runs in one folder both exited 0 with interleaved metrics and checkpoints.
    The holder is a run started with plain `python`: Ctrl-C (SIGINT) ends it with 130 after a
    checkpoint, printing the `python` command that resumes it (through `accelerate launch`:
    tests/test_launcher_stop.py). That a SIGKILLed run frees the folder, every resume of
    tests/test_fault_injection.py shows."""
    out = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        holder = start_holder(slow_args(tiny_model_dir, data_files, out), log)
    try:
        wait_for(
            lambda: (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step_*/training_state.json")),
            holder,
        )
        for extra in ({}, {"overwrite_output_dir": True}, {"resume_from_checkpoint": "latest"}):
            with pytest.raises(SystemExit) as exit_info:
                run_in_process("text_classification", slow_args(tiny_model_dir, data_files, out, **extra))
            message = str(exit_info.value.code)
            assert f"is in use by another run (PID {holder.pid})" in message and "\n" not in message, message
        assert (out / "checkpoints").is_dir(), "--overwrite_output_dir deleted the running run's files"
        holder.send_signal(signal.SIGINT)
        assert holder.wait(timeout=300) == 130, (tmp_path / "log").read_text()[-3000:]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    output = (tmp_path / "log").read_text()
    script = ROOT / "recipes" / "text_classification.py"
    assert f"python {script}" in output and "--resume_from_checkpoint latest" in output, output[-3000:]
    done = len(read_metrics(out))
    assert (out / "checkpoints" / f"step_{done:06d}" / "training_state.json").is_file()
    results = run_in_process(
        "text_classification",
        slow_args(tiny_model_dir, data_files, out, resume_from_checkpoint="latest", max_train_steps=done + 4),
    )
    assert results["num_update_steps"] == done + 4
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(1, done + 5)), "metrics.jsonl holds each update once, in order"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("recipe: text_classification\n  grid: [1\n", "is not valid YAML at line 2"),
        ("recipe: text_classification\ngrid: 5\n", "grid must be a mapping"),
        ("recipe: text_classification\nbase: [1]\ngrid: {seed: [1]}\n", "base must be a mapping"),
        (
            "recipe: text_classification\ngrid: {per_device_train_batch_size: [4.5]}\n",
            "must be a whole number, got 4.5",
        ),
        ("recipe: text_classification\ntimeout_per_run: abc\ngrid: {seed: [1]}\n", "cannot read the duration"),
    ],
)
def test_sweep_file_mistakes_are_one_line(tmp_path, text, expected):
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(text)
    assert expected in cli_error(["sweep", str(sweep_file), "--dry-run"])
