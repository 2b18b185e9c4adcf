"""NEFTune under accumulation: does the split change the update? Ours against the Transformers Trainer (issue 65).

    python benchmarks/bench_neftune.py [--output benchmarks/results/neftune.json]

The same tiny Llama (SmolLM2-135M-Instruct's tokenizer and chat template, 2 layers of width 32, from
`ft_accum.testing.make_tiny_chat_lm`), the same 8 conversations (answers of 1 to 40 words, so rows of
very unequal length), fp32 on the CPU, one update of SGD at a constant LR, no clipping: the
instruction recipe with `--neftune_noise_alpha`, and `transformers.Trainer` with
`neftune_noise_alpha` on the recipe's own tokenized rows (assistant-only labels, padded per
micro-batch by `DataCollatorForSeq2Seq`), the rows in one fixed order. Each toolkit runs (8 × 1) and
(2 × 4); the figure is ‖Δθ(2 × 4) − Δθ(8 × 1)‖ / ‖Δθ(8 × 1)‖, how far the split moves the update, with
NEFTune off (α = 0: the accumulation alone) and on (α = 5, the paper's). Exact accumulation of a
split-invariant noise gives fp32 rounding (~1e-7).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ft_accum.testing import (  # noqa: E402
    make_conversations,
    make_tiny_chat_lm,
    reset_accelerate_state,
    run_in_process,
    write_jsonl,
)

LEARNING_RATE = 0.5
ROWS = 8
SPLITS = [(8, 1), (2, 4)]
ALPHAS = [0.0, 5.0]


def initial_weights(model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()}


def trainer_update(model_dir: Path, rows: list[dict], micro: int, accumulation: int, alpha: float, work: Path):
    """θ after one Trainer update of the 8 rows in order (its sampler made sequential)."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = TrainingArguments(
        output_dir=str(work / f"trainer-{micro}x{accumulation}-{alpha}"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, learning_rate=LEARNING_RATE, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=1e9, max_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, weight_decay=0.0, neftune_noise_alpha=alpha or None,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows),
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True), processing_class=tokenizer,
    )  # fmt: skip
    trainer._get_train_sampler = lambda *a, **k: SequentialSampler(trainer.train_dataset)
    try:
        trainer.train()
    finally:
        reset_accelerate_state()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def our_update(model_dir: Path, data: Path, micro: int, accumulation: int, alpha: float, work: Path):
    """θ after one update of the instruction recipe over the same 8 conversations."""
    from safetensors.torch import load_file

    out = work / f"ours-{micro}x{accumulation}-{alpha}"
    run_in_process(
        "instruction_tuning",
        [f"--model_name_or_path={model_dir}", f"--train_file={data}", f"--validation_file={data}",
         f"--output_dir={out}", f"--per_device_train_batch_size={micro}", f"--gradient_accumulation_steps={accumulation}",
         "--max_train_steps=1", "--max_eval_samples=1", "--max_new_tokens=1", "--optim=sgd", f"--learning_rate={LEARNING_RATE}",
         "--lr_scheduler_type=constant", "--max_grad_norm=0", "--num_warmup_steps=0", "--weight_decay=0",
         "--lr_scaling=none", "--max_seq_length=512", "--seed=0", "--report_to=none",
         *([f"--neftune_noise_alpha={alpha}"] if alpha else [])],
    )  # fmt: skip
    return load_file(str(out / "final" / "model.safetensors"))


def split_difference(updates: dict, start: dict) -> float:
    """‖Δθ(split) − Δθ(full)‖ / ‖Δθ(full)‖ over the weights both saved (a tied output layer is saved once)."""
    full, split = updates[SPLITS[0]], updates[SPLITS[1]]
    keys = sorted(set(full) & set(split) & set(start))
    moved = torch.cat([(full[k].double() - start[k].double()).flatten() for k in keys])
    apart = torch.cat([(split[k].double() - full[k].double()).flatten() for k in keys])
    return float(apart.norm() / moved.norm())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from ft_accum.data import chat_data

    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        model_dir = make_tiny_chat_lm(work / "model")
        conversations = make_conversations(ROWS, seed=3)
        data = write_jsonl(work / "train.jsonl", conversations)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        rows = chat_data.tokenize_chats(tokenizer, [c["messages"] for c in conversations], 512).rows
        lengths = sorted(len(r["input_ids"]) for r in rows)
        start = initial_weights(model_dir)
        table = {}
        for alpha in ALPHAS:
            ours = {s: our_update(model_dir, data, *s, alpha, work) for s in SPLITS}
            theirs = {s: trainer_update(model_dir, rows, *s, alpha, work) for s in SPLITS}
            table[alpha] = {"ours": split_difference(ours, start), "trainer": split_difference(theirs, start)}
    import transformers

    results = {
        "command": "python benchmarks/bench_neftune.py" + (f" --output {args.output}" if args.output else ""),
        "date": time.strftime("%Y-%m-%d"), "minutes": round((time.time() - started) / 60, 1),
        "machine": f"{platform.processor() or platform.machine()}, GPU: none", "torch": torch.__version__,
        "transformers": transformers.__version__, "row_lengths": lengths,
        "relative_split_difference": {str(alpha): row for alpha, row in table.items()},
    }  # fmt: skip
    print("| NEFTune α | ours: (2 × 4) against (8 × 1) | Trainer: (2 × 4) against (8 × 1) |")
    print("|---|---|---|")
    for alpha, row in table.items():
        print(f"| {alpha:g} | {row['ours']:.1e} | {row['trainer']:.1e} |")
    if args.output:
        args.output.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
