"""GPU check 10: the vision-language recipe's CUDA peak against `ft-accum plan --task vision_language`'s."""

from collections.abc import Iterator
from pathlib import Path

from ft_accum.testing.gpu_checks.common import (
    planned_peak_gib,
    planner_row,
    random_model_dir,
    widest_bf16_run,
)

SMOLVLM_IMAGE_SIZE, SMOLVLM_PATCH_SIZE, SMOLVLM_SCALE_FACTOR = 384, 14, 3  # smolvlm-instruct.json's


def random_smolvlm_instruct(path: Path, smollm2: Path) -> Path:
    """SmolVLM-Instruct's architecture (planner/model_configs/smolvlm-instruct.json: a SigLIP tower of
    27 layers at 384 px, a Llama of 24 layers of 2,048) with random weights, and SmolVLM's processor
    layout around SmolLM2's tokenizer: its 49,152 words and the three image tokens are the config's
    49,155, `<image>` its id 49,153; an image is 81 tokens (27² patches pixel-shuffled by 3²)."""
    from transformers import AutoTokenizer

    from ft_accum.data.offline_vlm import IMAGE_TOKENS, assembled_processor
    from ft_accum.planner.configs import load_model_config

    config = load_model_config("smolvlm-instruct")
    random_model_dir(config, "vision_language", path, smollm2)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    assert len(tokenizer) == config.text_config.vocab_size
    assert tokenizer.convert_tokens_to_ids("<image>") == config.image_token_id
    processor = assembled_processor(tokenizer, SMOLVLM_IMAGE_SIZE, SMOLVLM_PATCH_SIZE, SMOLVLM_SCALE_FACTOR)
    processor.save_pretrained(path)
    return path


def check_vision_language(models: Path, smollm2: Path | None, dry_run: bool) -> Iterator[dict]:
    """recipes/vision_language.py on SmolVLM-Instruct's sizes (random weights), LoRA r 16 on every
    linear layer of the language model, the vision tower frozen (as a pretrained one is), bf16 mixed
    precision, the offline digits questions (0 to 2 images each) at --max_seq_length 256, 4 × 4, 3
    updates: the plan's peak for that split (the widest training micro-batch the run built, with its
    most images a conversation) against the run's CUDA peak. Pass: 0.90–1.10. Tokens per second are
    reported."""
    from transformers import AutoConfig, Idefics3ForConditionalGeneration

    from ft_accum.planner.memory_planner import plan
    from ft_accum.testing import make_tiny_chat_lm

    micro, accumulation, max_length = 4, 4, 256
    if dry_run:  # the offline default's tiny tower around the tests' 2-layer Llama: a smoke test, not figures
        from ft_accum.data.offline_vlm import assemble_smolvlm

        model_dir = assemble_smolvlm(make_tiny_chat_lm(models / "tiny-chat-vl"), models / "tiny-smolvlm")
        micro, accumulation, max_length = 2, 2, 96
    else:
        from ft_accum.data.offline_assets import bundled_smollm2_dir

        model_dir = random_smolvlm_instruct(models / "smolvlm-instruct-random", smollm2 or bundled_smollm2_dir())
    updates = 3
    args = [
        f"--model_name_or_path={model_dir}",
        f"--per_device_train_batch_size={micro}",
        f"--effective_batch_size={micro * accumulation}",
        f"--max_seq_length={max_length}",
        f"--max_train_steps={updates}",
        f"--max_train_samples={updates * micro * accumulation}",
        "--max_eval_samples=2",
        "--max_new_tokens=1",
        "--use_lora",
        "--lora_r=16",
        "--lora_alpha=32",
        "--lora_target_modules=all-linear",
        "--train_vision_tower=false",
        "--learning_rate=1e-4",
        "--lr_scaling=none",
    ]
    widest, measured, rate = widest_bf16_run("vision_language", args, Idefics3ForConditionalGeneration, warmup=1)
    config = AutoConfig.from_pretrained(model_dir)
    planned = plan(
        config,
        task="vision_language",
        seq_len=widest.seq_len,
        effective_batch_size=micro * accumulation,
        gpu_memory_gib=80,
        precision="bf16-mixed",
        lora_r=16,
        image_size=config.vision_config.image_size,
        images_per_sample=max(1, widest.images_per_sample),
    )
    predicted = planned_peak_gib(planned, micro)
    check = (
        f"vision-language planner / recipe peak, SmolVLM-Instruct sizes, LoRA r 16, tower frozen, {micro} × "
        f"{widest.seq_len} tokens, ≤{widest.images_per_sample} images, bf16"
    )
    yield planner_row(check, predicted, measured, dry_run, f"; {rate:,.0f} tokens/s", tokens_per_second=rate)
