"""GPU check 9: the contrastive recipe's CUDA peak against `ft-accum plan --task contrastive`'s."""

import json
from collections.abc import Iterator
from pathlib import Path

from ft_accum.testing.gpu_checks.common import (
    planned_peak_gib,
    planner_row,
    random_model_dir,
    widest_bf16_run,
)


def long_pairs(path: Path, rows: int, words: int) -> Path:
    """`rows` BBC News articles as pairs of their first and next `words` body words: both texts fill
    --max_seq_length, so every micro-batch is the planner's case (an anchor and a positive of seq_len
    tokens each). The bundled pairs (headline → opening sentence) are short and uneven."""
    from ft_accum.data.offline_assets import load_bbc_news, title_and_body

    bodies = [title_and_body(text)[1] for text in load_bbc_news(seed=42)["train"]["text"]]
    pairs = [b for b in bodies if len(b) >= 2 * words][:rows]
    path.write_text(
        "".join(
            json.dumps({"anchor": " ".join(b[:words]), "positive": " ".join(b[words : 2 * words])}) + "\n"
            for b in pairs
        )
    )
    return path


def check_contrastive(models: Path, minilm: Path, dry_run: bool) -> Iterator[dict]:
    """recipes/contrastive_embedding.py on a BERT of bert-base-uncased's sizes (random weights, the
    MiniLM tokenizer: the same 30,522 words), bf16 mixed precision, 32 × 8 pairs of 128 tokens, 3
    updates: the plan's peak for that split (the model's step and the update's embedding cache)
    against the run's CUDA peak. Pass: 0.90–1.10. The tokens per second are reported."""
    from transformers import AutoConfig, BertModel

    from ft_accum.planner.configs import load_model_config
    from ft_accum.planner.memory_planner import plan

    micro, accumulation, max_length = 32, 8, 128
    if dry_run:  # the 1-layer MiniLM: a smoke test of the run, not figures
        model_dir, micro, accumulation, max_length = minilm, 4, 2, 32
    else:
        model_dir = random_model_dir(
            load_model_config("bert-base-uncased"), "contrastive", models / "bert-base-random"
        )
    updates = 3
    # the recipe holds 10% of a --train_file out for evaluation: 3 whole updates stay
    rows = round(updates * micro * accumulation / 0.9) + 16
    train_file = long_pairs(models / "long_pairs.jsonl", rows, words=max_length)
    args = [
        f"--model_name_or_path={model_dir}",
        f"--train_file={train_file}",
        f"--per_device_train_batch_size={micro}",
        f"--effective_batch_size={micro * accumulation}",
        f"--max_seq_length={max_length}",
        f"--max_train_steps={updates}",
        "--max_eval_samples=16",
        "--learning_rate=1e-4",
        "--lr_scaling=none",
    ]
    widest, measured, rate = widest_bf16_run("contrastive_embedding", args, BertModel, warmup=1)
    planned = plan(
        AutoConfig.from_pretrained(model_dir),
        task="contrastive",
        seq_len=widest.seq_len,
        effective_batch_size=micro * accumulation,
        gpu_memory_gib=80,
        precision="bf16-mixed",
    )
    predicted = planned_peak_gib(planned, micro)
    check = (
        f"contrastive planner / recipe peak, bert-base-uncased sizes, {micro} × {accumulation} pairs of "
        f"{widest.seq_len} tokens, bf16"
    )
    yield planner_row(check, predicted, measured, dry_run, f"; {rate:,.0f} tokens/s", tokens_per_second=rate)
