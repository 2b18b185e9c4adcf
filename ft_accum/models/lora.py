"""LoRA through peft, an optional dependency (`pip install -e ".[lm]"`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft_accum.core.errors import ConfigError


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


@dataclass(frozen=True)
class LoraSettings:
    """The --lora_* flags: rank, alpha, dropout, the target modules (a comma list, or all-linear) and
    peft's variants: rsLoRA scales the update by alpha / sqrt(r) instead of alpha / r (Kalajdzievski
    2023, arXiv:2312.03732); DoRA trains each weight's magnitude apart from its direction (Liu et al.
    2024, arXiv:2402.09353)."""

    r: int
    alpha: int
    dropout: float
    target_modules: str
    use_rslora: bool = False
    use_dora: bool = False


def apply_lora(
    model,
    settings: LoraSettings,
    gradient_checkpointing: bool,
    model_dtype: str = "float32",
    target_modules: str | None = None,
    modules_to_save: list[str] | None = None,
):
    """Wrap a causal LM in a LoRA adapter from the recipe's --lora_* flags (peft's `get_peft_model`).
    `target_modules` (a regex peft matches against full module names) replaces --lora_target_modules,
    and `modules_to_save` train whole and are saved with the adapter (a vision-language model's
    connector).

    The adapters are the trained weights, so they take --model_dtype: peft creates them in fp32,
    and `bfloat16` casts them (half the adapter, gradient and AdamW bytes; updates below 1/256 of a
    weight are lost, as for any bf16 training).
    """
    peft = import_peft()
    lora_config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=target_modules or parse_target_modules(settings.target_modules),
        modules_to_save=modules_to_save,
        use_rslora=settings.use_rslora,
        use_dora=settings.use_dora,
    )
    model = peft.get_peft_model(model, lora_config)
    # What trains takes --model_dtype, whatever dtype the frozen base runs in (modules_to_save are copies of it).
    trained_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[model_dtype]
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.to(trained_dtype)
    if gradient_checkpointing:
        # The frozen embeddings would give checkpointed blocks inputs without grad; this keeps the graph alive.
        model.enable_input_require_grads()
    return model


def describe_trainable(model, lora_r: int | None = None) -> str:
    """The banner's line: trainable parameters of all, and the LoRA rank if any."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora_rank = f" (LoRA r={lora_r})" if lora_r else ""
    return f"{trainable:,} of {sum(p.numel() for p in model.parameters()):,} parameters{lora_rank}"
