"""LoRA through peft, an optional dependency (`pip install -e ".[lm]"`)."""

from __future__ import annotations

from ft_accum.errors import ConfigError


def import_peft():
    """The peft module, or a ConfigError that names the extra to install."""
    try:
        import peft
    except ImportError:
        raise ConfigError(
            '--use_lora needs peft, which is not installed; pip install -e ".[lm]" (or pip install peft)'
        ) from None
    return peft


def parse_target_modules(value: str) -> str | list[str]:
    """`q_proj,v_proj` → ["q_proj", "v_proj"]; `all-linear` is passed through to peft as is."""
    return value if value == "all-linear" else [m.strip() for m in value.split(",") if m.strip()]
