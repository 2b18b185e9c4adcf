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


def apply_lora(model, task_args, gradient_checkpointing: bool):
    """Wrap a causal LM in a LoRA adapter from the recipe's --lora_* flags (peft's `get_peft_model`)."""
    peft = import_peft()
    lora_config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=task_args.lora_r,
        lora_alpha=task_args.lora_alpha,
        lora_dropout=task_args.lora_dropout,
        target_modules=parse_target_modules(task_args.lora_target_modules),
    )
    model = peft.get_peft_model(model, lora_config)
    if gradient_checkpointing:
        # The frozen embeddings would give checkpointed blocks inputs without grad; this keeps the graph alive.
        model.enable_input_require_grads()
    return model


def describe_trainable(model, task_args) -> str:
    """The banner's line: trainable parameters of all, and the LoRA rank if any."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora_rank = f" (LoRA r={task_args.lora_r})" if task_args.use_lora else ""
    return f"{trainable:,} of {sum(p.numel() for p in model.parameters()):,} parameters{lora_rank}"


def save_merged(task_args, accelerator, model, tokenizer, output_dir) -> dict:
    """--merge_lora: the base with the adapter merged into final_merged/ (nothing without LoRA)."""
    if task_args.use_lora and task_args.merge_lora:
        from ft_accum.run_outputs import save_final

        merged = accelerator.unwrap_model(model).merge_and_unload()
        save_final(accelerator, merged, tokenizer, output_dir, name="final_merged")
    return {}
