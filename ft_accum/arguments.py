"""Command-line and YAML arguments for recipes, through `transformers.HfArgumentParser`.

`--config file.yaml` supplies defaults; flags on the command line override them. This order is
what users expect from `accelerate launch recipe.py --config base.yaml --learning_rate 1e-4`, and
it is why the YAML is applied with `set_defaults` instead of `HfArgumentParser.parse_yaml_file`
(which ignores the command line).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TypeVar

import yaml
from transformers import HfArgumentParser

from ft_accum.errors import ConfigError

T = TypeVar("T")


def parse_config(config_class: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """Parse `argv` (default: sys.argv[1:]) into `config_class`, with `--config YAML` as defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)

    # Keep the recipe docstring's line breaks (its first line is the launch command) and show defaults.
    formatter = type("HelpFormatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {})
    parser = HfArgumentParser(config_class, description=description, formatter_class=formatter)
    parser.add_argument("--config", default=None, help="YAML file of defaults; command-line flags override it")
    if known.config:
        parser.set_defaults(**read_yaml_config(known.config, config_class))
    parsed, _ = parser.parse_args_into_dataclasses(args=argv)
    return parsed


def read_yaml_config(path: str | Path, config_class: type) -> dict:
    """The YAML mapping, after checking that every key is a field of `config_class`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path} does not exist; pass a YAML file such as recipes/configs/<recipe>.yaml")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must hold a mapping of setting: value, got {type(values).__name__}")
    fields = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"--config {path} has unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
    return values


def require_at_least(config, minimum: int, *names: str) -> None:
    """Each named setting that is set (not None) must be ≥ `minimum`: zero or negative sizes are typos."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name} must be ≥ {minimum}, got {value}")
