"""Loading a pretrained model or tokenizer with errors that name the fix, shared by every recipe."""

from __future__ import annotations

import os

from ft_accum.errors import ConfigError


def check_model_path(name: str) -> None:
    """A path-like --model_name_or_path must exist (a typo must not turn into a hub download attempt)."""
    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(f"--model_name_or_path {name} does not exist; pass a folder holding config.json, or a hub name")


def load_pretrained(auto_class, name: str, trust_remote_code: bool = False, **kwargs):
    """`auto_class.from_pretrained(name, ...)`, with a one-line ConfigError instead of a deep traceback.

    ValueError is what transformers raises for a model that needs its own code while
    trust_remote_code is off; OSError covers a missing folder, file or hub name offline.
    """
    check_model_path(name)
    try:
        return auto_class.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        hint = "pass --trust_remote_code only if you trust its code" if "trust_remote_code" in str(exc) else "pass a local folder, or go online for hub names"
        raise ConfigError(f"could not load model {name!r}: {str(exc).strip().splitlines()[0]} ({hint})") from exc


def check_context_length(model, length: int, flag: str) -> None:
    """Refuse sequences longer than the model's position embeddings (they would index past them)."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context and length > context:
        raise ConfigError(f"{flag} {length} is longer than the model's {context} positions; use {flag} {context} or less")
