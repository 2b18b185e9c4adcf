"""Settings read from YAML: a recipe's --config file (every key a field, every value of the field's type),
and the safe loading and typing that `ft-accum sweep` and `search` share.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import yaml

from ft_accum.core.errors import ConfigError


def read_yaml_config(path: str | Path, *config_classes: type) -> dict:
    """The YAML mapping, after checking that every key is a field of one of `config_classes` and that
    every value has the field's type (set_defaults skips argparse's conversion, so a YAML value
    would otherwise reach the run as written: `4.5` for a batch size, `100:64` read as 6064)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path} does not exist; pass a YAML file such as recipes/configs/<recipe>.yaml")
    values = read_yaml(path, "--config ")
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must hold a mapping of setting: value, got {type(values).__name__}")
    fields = {f.name for cls in config_classes for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"--config {path} has unknown setting(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}"
        )
    hints = {name: hint for cls in config_classes for name, hint in typing.get_type_hints(cls).items()}
    return {key: typed_value(value, hints[key], f"--config {path}: {key}") for key, value in values.items()}


def read_yaml(path: Path, what: str = "") -> typing.Any:
    """`yaml.safe_load` of `path` (None → {}), with a syntax error as one ConfigError line naming its place."""
    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(
            f"{what}{path} is not valid YAML{line}: {problem}; write one 'setting: value' per line"
        ) from None


def typed_value(value, hint, where: str):
    """`value` as the field type `hint` wants (int, float, bool, str, or Optional of one), or a ConfigError."""
    optional = type(None) in typing.get_args(hint)
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint) if optional else hint
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} needs a value")
    if base is bool and isinstance(value, bool):
        return value
    if base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if base is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            return float(value)  # YAML 1.1 reads 1e-4 (no dot) as text
        except ValueError:
            pass
    if base is str and isinstance(value, str):
        return value
    kind = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}.get(base, str(base))
    hint_text = " (quote it: YAML reads 100:30 as the number 6030)" if base is str else ""
    raise ConfigError(f"{where} must be {kind}, got {value!r}{hint_text}")
