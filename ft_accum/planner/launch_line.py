"""A plan's recommendation as the whole `accelerate launch` command: the Accelerate config and every recipe flag."""

from __future__ import annotations

from ft_accum.planner.task_specs import task_spec


def launch_line(result: dict) -> str | None:
    """The recommended configuration as a whole `accelerate launch` command: the Accelerate config for
    the precision, and every recipe flag the plan assumed (dtype, optimizer, LoRA, 4-bit base,
    offloading, checkpointing), not only the split. None when nothing fits.

    The planner's precisions map to the recipes' dtype policy: "bf16" is bf16 mixed precision with
    bf16 weights (--model_dtype bfloat16); under LoRA the frozen base is bf16 and the adapters fp32
    anyway, which is the recipes' default under bf16 mixed precision.
    """
    best = result["recommended"]
    if best is None:
        return None
    mixed_precision = {"fp16-mixed": "fp16", "fp32": "no"}.get(result["precision"], "bf16")
    if result["num_processes"] > 1:
        accelerate_config = (
            f"multi_gpu_ddp.yaml --num_processes {result['num_processes']} --mixed_precision {mixed_precision}"
        )
    else:
        accelerate_config = {"fp16": "single_gpu_fp16.yaml", "no": "single_gpu_bf16.yaml --mixed_precision no"}.get(
            mixed_precision, "single_gpu_bf16.yaml"
        )
    flags = [
        f"--per_device_train_batch_size {best['per_device_train_batch_size']}",
        f"--effective_batch_size {result['effective_batch_size']}",
        f"{task_spec(result['task']).sequence_flag} {result.get('completion_length') or result['seq_len']}",
    ]
    if best["gradient_checkpointing"]:
        flags.append("--gradient_checkpointing")
    # The plan allows offloading; the recommended candidate says whether it uses it.
    settings = {**result, "offload_activations": best.get("offload_activations", False)}
    recipe = result.get("recipe") or f"recipes/{task_spec(result['task']).recipe}.py"
    return (
        f"accelerate launch --config_file accelerate_configs/{accelerate_config} "
        f"{recipe} {' '.join(flags + recipe_flags(settings))}"
    )


def recipe_flags(settings: dict) -> list[str]:
    """The recipe's command-line words for a plan's dtype, optimizer, LoRA, 4-bit and offloading settings."""
    # The planner's "bf16" is bf16 weights in full fine-tuning; under LoRA only the frozen base is bf16.
    bf16_weights = settings.get("precision") == "bf16" and not settings.get("lora_r")
    flags = ["--model_dtype=bfloat16"] if bf16_weights else []
    flags += {
        # bf16 weights round small updates away unless rounded stochastically (docs/low_memory.md):
        # torchao's 8-bit AdamW does that, in the same bytes as bitsandbytes'.
        "adamw_8bit": ["--optim=adamw_torch_8bit" if bf16_weights else "--optim=adamw_8bit"],
        "sgd": ["--optim=sgd"],
        "adamw_4bit": ["(4-bit AdamW: torchao's, not in the recipes; see docs/low_memory.md)"],
    }.get(settings.get("optimizer", "adamw"), [])
    if settings.get("lora_r"):
        flags += ["--use_lora", f"--lora_r={settings['lora_r']}"]
    if settings.get("load_in_4bit"):
        flags.append("--load_in_4bit")
    if settings.get("offload_activations"):
        flags.append("--offload_activations")
    if settings.get("preference_loss", "dpo") != "dpo":
        flags.append(f"--loss={settings['preference_loss']}")
    if settings.get("precompute_ref_log_probs"):
        flags.append("--precompute_ref_log_probs")
    if settings.get("train_vision_tower"):
        flags.append("--train_vision_tower")
    if settings.get("student_layers"):
        flags.append(f"--student_layers={settings['student_layers']}")
    return flags
