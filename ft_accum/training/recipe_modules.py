"""A recipe file read without training it: loaded as a module by path (recipes/ is a folder of scripts, not
a package), and the arguments it would run with. How the planner and the command-line tools read a
recipe's own defaults, so that a copy's count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ft_accum.training.arguments import PARSE_ONLY, TrainingArguments


def load_recipe_module(path: str | Path):
    """The recipe file at `path` as a module (recipes/ is a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"loaded_recipe_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe_arguments(recipe, argv: list[str]) -> tuple[Any, TrainingArguments]:
    """(TaskArguments, TrainingArguments) that `recipe` (a recipe file's path, or its loaded module) would
    run with for `argv`: its own `main` and parser (its defaults, its config, the flags), with the
    training left out. How the command-line tools and the planner read a recipe's defaults, so that a
    copy's own defaults count."""
    module = load_recipe_module(recipe) if isinstance(recipe, (str, Path)) else recipe
    token = PARSE_ONLY.set(True)
    try:
        return module.main(argv)
    finally:
        PARSE_ONLY.reset(token)
