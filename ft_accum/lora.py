"""LoRA through peft, an optional dependency (`pip install -e ".[lm]"`)."""

from __future__ import annotations

import os

import torch

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


def apply_lora(model, task_args, gradient_checkpointing: bool, model_dtype: str = "float32"):
    """Wrap a causal LM in a LoRA adapter from the recipe's --lora_* flags (peft's `get_peft_model`).

    The adapters are the trained weights, so they take --model_dtype: peft creates them in fp32,
    and `bfloat16` casts them (half the adapter, gradient and AdamW bytes; updates below 1/256 of a
    weight are lost, as for any bf16 training).
    """
    peft = import_peft()
    lora_config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=task_args.lora_r,
        lora_alpha=task_args.lora_alpha,
        lora_dropout=task_args.lora_dropout,
        target_modules=parse_target_modules(task_args.lora_target_modules),
    )
    model = peft.get_peft_model(model, lora_config)
    if model_dtype == "bfloat16":
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.data = parameter.data.to(torch.bfloat16)
    if gradient_checkpointing:
        # The frozen embeddings would give checkpointed blocks inputs without grad; this keeps the graph alive.
        model.enable_input_require_grads()
    return model


def describe_trainable(model, task_args) -> str:
    """The banner's line: trainable parameters of all, and the LoRA rank if any."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    lora_rank = f" (LoRA r={task_args.lora_r})" if task_args.use_lora else ""
    return f"{trainable:,} of {sum(p.numel() for p in model.parameters()):,} parameters{lora_rank}"


def save_merged(task_args, accelerator, model, tokenizer, output_dir, base_name: str | None = None) -> dict:
    """--merge_lora: the base with the adapter merged into final_merged/ (nothing without LoRA).

    A 4-bit base (--load_in_4bit) is not merged into: its weights would be dequantized, summed and
    quantized again, and that last rounding would undo most of the adapter's small changes. The
    adapter (final/) is merged into a bf16 copy of the original base, `base_name`, instead. That is
    lossy too, the other way round: the adapter was trained against the NF4-rounded base, and the
    merged model has the unrounded one, so its outputs differ a little from those of the trained
    pair. The run says so; keep final/ to serve the exact trained pair on the 4-bit base.
    """
    if not (task_args.use_lora and task_args.merge_lora):
        return {}
    from ft_accum.run_outputs import save_final, write_pretrained

    if not getattr(task_args, "load_in_4bit", False):
        merged = accelerator.unwrap_model(model).merge_and_unload()
        save_final(accelerator, merged, tokenizer, output_dir, name="final_merged")
        return {}
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        from transformers import AutoModelForCausalLM

        peft = import_peft()
        base = AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.bfloat16)
        merged = peft.PeftModel.from_pretrained(base, os.path.join(output_dir, "final")).merge_and_unload()
        write_pretrained(merged, tokenizer, output_dir, "final_merged")
        accelerator.print(
            "final_merged/: the adapter merged into a bf16 copy of the base, not into its 4-bit weights (that would "
            "round the adapter's changes away); outputs differ a little from the trained 4-bit pair, which final/ keeps"
        )
    accelerator.wait_for_everyone()
    return {"merged_into": "bfloat16 copy of the base (lossy: trained against its NF4 rounding)"}
