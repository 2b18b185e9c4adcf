"""The recipes ship with the package (ft_accum/training/recipe_files.py): `ft-accum ls` lists them, `ft-accum cp`
copies one (and its config) out to edit, and after a plain, non-editable install the planner, `check` and
`sweep` find them from any directory."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT
from transformers import BertConfig

from ft_accum.cli.main import main as ft_accum
from ft_accum.core.errors import ConfigError
from ft_accum.planner.task_specs import TASKS
from ft_accum.training import recipe_files


def test_ls_lists_every_recipe_and_accelerate_config(capsys):
    assert ft_accum(["ls"]) == 0
    out = capsys.readouterr().out
    for recipe in (ROOT / "recipes").glob("*.py"):
        assert f"  {recipe.stem} " in out
    for config in (ROOT / "accelerate_configs").glob("*.yaml"):
        assert config.name in out


def test_cp_copies_a_recipe_with_its_config_named_after_the_copy_and_never_overwrites(tmp_path, capsys, monkeypatch):
    target = tmp_path / "tasks" / "my_task.py"
    assert ft_accum(["cp", "text_classification", str(target)]) == 0
    copy, config = target.read_text(), tmp_path / "tasks" / "configs" / "my_task.yaml"
    shipped = (ROOT / "recipes" / "text_classification.py").read_text()
    # The docstring's launch command runs the copy on its config; nothing else changes.
    assert f"{target} \\\n    --config {config}\n" in copy
    assert copy.count("\n") == shipped.count("\n") and "recipes/text_classification.py" not in copy
    shipped_config = (ROOT / "recipes" / "configs" / "text_classification.yaml").read_text()
    assert config.read_text().replace(str(target), "recipes/text_classification.py") == shipped_config
    assert recipe_files.config_of(target) == config  # where run_main reads a recipe's default config
    with pytest.raises(ConfigError, match="already exist"):
        recipe_files.copy_recipe("text_classification", target)
    # A cpu.yaml of the user's own in the working directory is not what `cp` copies: the shipped one is.
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "cpu.yaml").write_text("compute_environment: MY_OWN\n")
    monkeypatch.chdir(tmp_path / "here")
    assert ft_accum(["cp", "cpu.yaml", str(tmp_path)]) == 0
    assert (tmp_path / "cpu.yaml").read_text() == (ROOT / "accelerate_configs" / "cpu.yaml").read_text()
    with pytest.raises(ConfigError, match="unknown recipe 'text_clasification'.*text_classification"):
        recipe_files.copy_recipe("text_clasification", tmp_path)


def test_nothing_in_the_package_finds_a_recipe_beside_its_source():
    """The shipped files are found as package data (`_shipped/`), not as the clone's folders."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "ft_accum").rglob("*.py")
        if "testing" not in path.parts and 'parents[2] / "recipes"' in path.read_text()
    ]
    assert offenders == []


@pytest.mark.launch
def test_a_plain_install_lists_copies_plans_and_runs_the_recipes_from_anywhere(tmp_path):
    """`pip install .` (a wheel, not editable): the package's own copies of the recipes and Accelerate
    configs, found from another directory; the copy of a recipe runs two updates through the real
    `accelerate launch`; `ft-accum plan` finds each task's recipe."""
    wheels, site, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    work.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(ROOT)], check=True, capture_output=True)
    (wheel,) = wheels.glob("ft_accum-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    # The installed copy first on the path, ahead of the editable install of this checkout.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}

    def run(*command: str, timeout: float = 300) -> str:
        result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return result.stdout

    ft = [sys.executable, "-m", "ft_accum.cli.main"]
    listing = run(*ft, "ls")
    assert f"shipped in {site / 'ft_accum' / '_shipped'}" in listing and "  text_classification " in listing
    assert not (site / "ft_accum" / "_shipped" / "recipes").is_symlink()  # files in the wheel, not links
    run(*ft, "cp", "text_classification", "my_task.py")
    shipped_cpu = site / "ft_accum" / "_shipped" / "accelerate_configs" / "cpu.yaml"
    run(sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(shipped_cpu), "my_task.py",
        "--max_train_steps", "2", "--max_train_samples", "96", "--max_eval_samples", "16", "--output_dir", "out")  # fmt: skip
    assert len((work / "out" / "metrics.jsonl").read_text().splitlines()) == 2
    assert (work / "out" / "final" / "model.safetensors").is_file()
    found = run(sys.executable, "-c", "from ft_accum.planner import task_specs\n"
                "for task in task_specs.TASKS: print(task_specs.recipe_path(task))")  # fmt: skip
    assert all(line.startswith(str(site)) for line in found.splitlines()) and len(found.splitlines()) == len(TASKS)
    # The plan traces the installed copy of the recipe's step; a 2-layer BERT keeps the trace short.
    tiny_bert = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    (work / "bert.json").write_text(tiny_bert.to_json_string())
    plan = run(*ft, "plan", "--task", "text_classification", "--model", "bert.json", "--seq_len", "64",
               "--effective_batch_size", "16", "--gpu_memory", "12GiB")  # fmt: skip
    assert "as a run:" in plan and "recipes/text_classification.py" in plan
