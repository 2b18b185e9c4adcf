"""The recipes and Accelerate configs that ship with the package, found as its data, not beside its source.

The wheel carries `recipes/` (with `recipes/configs/`) and `accelerate_configs/` under
`ft_accum/_shipped/`, where a clone has two links to the folders at its root (so an editable install
and `accelerate launch recipes/<name>.py` in a clone see the same files). `ft-accum ls` lists them and
`ft-accum cp` copies one out to edit, as torchtune's `tune cp` does; the planner, `ft-accum check`,
`sweep` and `search` find a recipe given by name here.
"""

from __future__ import annotations

import ast
import shutil
from importlib import resources
from pathlib import Path

from ft_accum.core.errors import ConfigError


def shipped_dir() -> Path:
    """The package's `_shipped/` folder (in a clone: links to its recipes/ and accelerate_configs/)."""
    return Path(str(resources.files("ft_accum") / "_shipped"))


def recipes_dir() -> Path:
    return shipped_dir() / "recipes"


def accelerate_configs_dir() -> Path:
    return shipped_dir() / "accelerate_configs"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.py"))


def accelerate_config_names() -> list[str]:
    return sorted(p.name for p in accelerate_configs_dir().glob("*.yaml"))


def shipped_recipe(name: str) -> Path:
    """The shipped recipe `name` (`text_classification` or `text_classification.py`)."""
    stem = name.removesuffix(".py")
    path = recipes_dir() / f"{stem}.py"
    if not path.is_file():
        raise ConfigError(
            f"unknown recipe {stem!r}: no such file, and no shipped recipe of that name; give a path to a recipe "
            f"file, or one of {', '.join(recipe_names())} (ft-accum ls)"
        )
    return path


def find_recipe(recipe: str | Path, *near: Path) -> Path:
    """A recipe given as a path to a file (relative to the working directory or to a folder of `near`;
    `.py` may be left out), or as the name of a shipped one (`text_classification`,
    `recipes/text_classification.py`)."""
    name = str(recipe) if str(recipe).endswith(".py") else f"{recipe}.py"
    for base in (Path.cwd(), *near):
        for candidate in (base / name, base / "recipes" / name):
            if candidate.is_file():
                return candidate.resolve()
    return shipped_recipe(Path(name).name)


def shipped_accelerate_config(name: str | Path) -> Path:
    """The shipped Accelerate config `name` (`cpu`, `cpu.yaml`, `accelerate_configs/cpu.yaml`)."""
    file_name = Path(name).name
    shipped = accelerate_configs_dir() / (file_name if file_name.endswith(".yaml") else f"{file_name}.yaml")
    if not shipped.is_file():
        names = ", ".join(accelerate_config_names())
        raise ConfigError(f"accelerate_config {name} does not exist; give a path, or a shipped one: {names}")
    return shipped.resolve()


def find_accelerate_config(config: str | Path, *near: Path) -> Path:
    """An Accelerate config given as a path (relative to the working directory or to a folder of `near`),
    or as a shipped one's name."""
    for base in (Path.cwd(), *near):
        if (base / config).is_file():
            return (base / config).resolve()
    return shipped_accelerate_config(config)


def config_of(recipe: Path) -> Path:
    """The recipe's config: `configs/<name>.yaml` beside it, as `run_main` reads it by default."""
    return recipe.parent / "configs" / f"{recipe.stem}.yaml"


def describe(recipe: Path, width: int = 90) -> str:
    """The paragraph after the launch command in the recipe's docstring, cut to `width` characters."""
    docstring = ast.get_docstring(ast.parse(recipe.read_text())) or ""
    paragraphs = [p.strip() for p in docstring.split("\n\n") if p.strip()]
    text = " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else ""
    return text if len(text) <= width else text[: width - 1].rsplit(" ", 1)[0] + " …"


def copy_recipe(name: str, destination: Path) -> list[Path]:
    """Copy the shipped recipe `name` to `destination` (a file, or a folder to put `<name>.py` in), with its
    config as `configs/<new name>.yaml` beside it; the docstring's launch command names the copies.
    An existing file is never overwritten. Returns the written paths."""
    source = shipped_recipe(name)
    target = destination / source.name if destination.is_dir() else destination
    if target.suffix != ".py":
        raise ConfigError(f"copy a recipe to a .py file or a folder, not {destination}")
    copies = {target: source.read_text()}
    if config_of(source).is_file():
        copies[config_of(target)] = config_of(source).read_text()
    existing = [str(p) for p in copies if p.exists()]
    if existing:
        raise ConfigError(f"{', '.join(existing)} already exist(s); copy to another name, or remove it first")
    shipped_paths = (f"recipes/configs/{source.stem}.yaml", f"recipes/{source.name}")
    new_paths = (str(config_of(target)), str(target))
    for path, text in copies.items():
        for old, new in zip(shipped_paths, new_paths):
            text = text.replace(old, new)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return list(copies)


def copy_accelerate_config(name: str, destination: Path) -> Path:
    """Copy the shipped Accelerate config `name` (`cpu.yaml`) to `destination` (a file or a folder)."""
    source = shipped_accelerate_config(name)
    target = destination / source.name if destination.is_dir() else destination
    if target.exists():
        raise ConfigError(f"{target} already exists; copy to another name, or remove it first")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target
