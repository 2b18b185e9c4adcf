"""Every shipped YAML parses, and every recipe's docstring launch command runs as written."""

import dataclasses
import shlex
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import ROOT, load_recipe

from ft_accum.training.yaml_config import read_yaml_config

ACCELERATE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
EXPECTED = {
    "cpu",
    "single_gpu_fp16",
    "single_gpu_bf16",
    "multi_gpu_ddp",
    "multi_node_ddp",
    "fsdp",
    "deepspeed_zero2",
    "deepspeed_zero3_offload",
}


def test_every_documented_accelerate_config_is_shipped():
    assert {p.stem for p in ACCELERATE_CONFIGS} >= EXPECTED


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_config_loads_with_accelerate(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    comment = path.read_text().splitlines()[0]
    assert comment.startswith("#"), "each config starts with a comment saying when to use it"


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_config_matches_its_dataclass(recipe):
    from ft_accum.training.arguments import TrainingArguments

    module = load_recipe(recipe)
    values = read_yaml_config(ROOT / "recipes" / "configs" / f"{recipe}.yaml", module.TaskArguments, TrainingArguments)
    task_fields = {f.name for f in dataclasses.fields(module.TaskArguments)}
    module.TaskArguments(**{k: v for k, v in values.items() if k in task_fields})
    config = TrainingArguments(**{k: v for k, v in values.items() if k not in task_fields})
    # learning_rate and base_batch_size travel as a pair, so scaling has a reference point.
    assert "learning_rate" in values and "base_batch_size" in values and config.base_batch_size


def docstring_command(recipe: str) -> list[str]:
    # The command may continue over lines with a shell backslash, as it would be pasted into a shell.
    docstring = (ROOT / "recipes" / f"{recipe}.py").read_text().split('"""')[1].strip()
    first_line = docstring.split("\n\n")[0].replace("\\\n", " ")
    assert first_line.startswith("accelerate launch "), first_line
    return shlex.split(first_line)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_docstring_command_is_a_valid_launch_of_the_run_the_contract_test_checks(recipe):
    """The first line of the docstring, as a user pastes it: Accelerate's own launch parser accepts
    it, its --config_file is a shipped Accelerate config, the script is this recipe, and its recipe
    flags give the settings of a run with no flags, which tests/test_recipe_contract.py runs (its
    own config, model and data) through `ft-accum check`. Each recipe's launch through the real
    `accelerate launch` CLI is in its own test file (2 DDP processes on uneven rows)."""
    from accelerate.commands.launch import launch_command_parser

    from ft_accum.training.arguments import parse_args

    cmd = docstring_command(recipe)
    launch_args = launch_command_parser().parse_args(cmd[2:])
    assert Path(ROOT / launch_args.config_file) in ACCELERATE_CONFIGS
    assert (ROOT / launch_args.training_script).resolve() == (ROOT / "recipes" / f"{recipe}.py").resolve()
    module = load_recipe(recipe)
    default_config = ROOT / "recipes" / "configs" / f"{recipe}.yaml"
    as_documented = parse_args(module.TaskArguments, launch_args.training_script_args, default_config=default_config)
    assert as_documented == parse_args(module.TaskArguments, [], default_config=default_config)


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_lists_the_flags(recipe, capsys):
    # In-process: a subprocess would spend ~8 s per recipe importing torch and transformers.
    from conftest import load_recipe

    with pytest.raises(SystemExit) as exit_info:
        load_recipe(recipe).main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "accelerate launch" in out  # the docstring, launch command first
    for flag in (
        "--per_device_train_batch_size",
        "--effective_batch_size",
        "--base_batch_size",
        "--resume_from_checkpoint",
        "--measure_noise_scale",
    ):
        assert flag in out


def test_the_example_sweep_file_is_valid():
    from ft_accum.cli.sweep import load_sweep

    sweep = load_sweep(ROOT / "recipes" / "configs" / "sweep_text_classification.yaml")
    assert len(sweep["runs"]) == 4 and Path(sweep["accelerate_config"]).is_file()


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
def test_a_run_with_no_flags_is_the_run_of_its_config_file(recipe):
    """Issue 27: with no flags a recipe ignored its own config (text classification ran 669 updates at
    8 × 1 instead of 60 at 8 × 4). The settings with no flags must be those of --config <its file>;
    flags still override, and --config none leaves the dataclass defaults."""
    from ft_accum.training.arguments import parse_args

    module = load_recipe(recipe)
    config = ROOT / "recipes" / "configs" / f"{recipe}.yaml"
    default = parse_args(module.TaskArguments, [], default_config=config)
    explicit = parse_args(module.TaskArguments, ["--config", str(config)])
    assert default == explicit
    if config.is_file():
        assert default != parse_args(module.TaskArguments, ["--config", "none"], default_config=config)
        _, args = parse_args(module.TaskArguments, ["--gradient_accumulation_steps", "2"], default_config=config)
        assert args.gradient_accumulation_steps == 2 and args.effective_batch_size is None
        _, args = parse_args(module.TaskArguments, ["--seed", "5"], default_config=config)
        assert args.seed == 5
