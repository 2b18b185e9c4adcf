"""GPU check 6 (reported, not judged): the instruction-tuning recipe's tokens per second and peak,
full fine-tuning with packing off and on, and QLoRA.
"""

from collections.abc import Iterator
from pathlib import Path

from ft_accum.testing.gpu_checks.common import DRY_RUN_VOCAB, random_model_dir, recipe_run


def check_instruction_tuning(models: Path, dry_run: bool) -> Iterator[dict]:
    """Reported, not judged: recipes/instruction_tuning.py's tokens per second and peak on a Llama of
    Qwen2.5-0.5B's sizes (random weights, the MiniLM tokenizer with ChatML; a qwen2 model type would
    make transformers load a Qwen2 tokenizer from MiniLM's files, which splits text into characters)
    on the bundled BBC instructions, bf16 mixed precision, 8 × 4, 12 updates of which the first 2 are
    warm-up: full fine-tuning with packing off and on, and QLoRA (a 4-bit base, LoRA r 16) with
    packing on."""
    from ft_accum.planner.configs import load_model_config
    from ft_accum.testing.benchmarking import steady_rate

    config = load_model_config("llama-3.1-8b")
    qwen = load_model_config("qwen2.5-0.5b")
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    config.update({name: getattr(qwen, name) for name in sizes} | {"head_dim": 64, "tie_word_embeddings": True})
    micro, accumulation, updates, seq_len = 8, 4, 12, 512
    if dry_run:  # one 64-wide layer: a smoke test of the runs, not figures
        config.update({"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "head_dim": 32, "vocab_size": DRY_RUN_VOCAB})  # fmt: skip
        micro, accumulation, updates, seq_len = 2, 2, 3, 256
    model_dir = random_model_dir(config, "causal_lm", models / "llama-0.5b-instruct")
    common = [
        f"--model_name_or_path={model_dir}",
        "--chat_template=chatml",
        f"--max_seq_length={seq_len}",
        f"--per_device_train_batch_size={micro}",
        f"--gradient_accumulation_steps={accumulation}",
        f"--max_train_steps={updates}",
        "--max_eval_samples=4",
        "--per_device_eval_batch_size=4",
        "--learning_rate=1e-4",
        "--lr_scaling=none",
    ]
    variants = {
        "full, packing off": [],
        "full, packing on": ["--packing"],
        "QLoRA r 16, packing on": ["--packing", "--use_lora", "--lora_r=16", "--load_in_4bit"],
    }
    first = None
    for name, flags in variants.items():  # a row each, so that a run stopped at its limit keeps the first
        _, peak, records = recipe_run("instruction_tuning", [*common, *flags], "bf16")
        rate = steady_rate([r["tokens_per_second"] for r in records], warmup=2)
        first = first or (name, rate)
        yield {
            "check": f"instruction tuning, {name}, Llama of Qwen2.5-0.5B sizes, {micro} × {accumulation} × "
            f"≤{seq_len} tokens, bf16",
            "measured": f"{rate:,.0f} tokens/s ({rate / first[1]:.2f}× {first[0]}), peak {peak:.2f} GiB",
            "tokens_per_second": rate,
            "peak_gib": peak,
            "bound": "reported",
            "pass": True,
        }
