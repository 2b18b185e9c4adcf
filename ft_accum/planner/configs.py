"""Model configs for the planner: a shipped name (model_configs/*.json), a config.json, a folder, or a hub name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ft_accum.core.errors import ConfigError

SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"


def shipped_config_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))


def load_model_config(model: str | Any):
    """A `PretrainedConfig` from: a config object, a shipped name, a config.json, a local folder, or a hub name (online)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    path = Path(model)
    if (SHIPPED_CONFIGS / f"{model}.json").is_file():
        path = SHIPPED_CONFIGS / f"{model}.json"
    if path.is_file():
        try:
            values = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc}); pass a transformers config.json") from None
        if not isinstance(values, dict) or "model_type" not in values:
            raise ConfigError(f"{path} has no model_type; it must be a transformers config.json")
        try:
            return AutoConfig.for_model(**values)
        except (ValueError, KeyError) as exc:
            raise ConfigError(
                f"{path}: transformers does not know model_type {values['model_type']!r} ({str(exc).splitlines()[0][:120]}); "
                "check the name, or upgrade transformers"
            ) from None
    try:
        return AutoConfig.from_pretrained(str(model))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"could not load the config of {model!r} ({str(exc).strip().splitlines()[0][:160]}); offline, pass --config "
            f"path/to/config.json or a folder holding one, or a shipped name: {', '.join(shipped_config_names())}"
        ) from exc
