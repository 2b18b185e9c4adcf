"""Generate the README's "what fits on a 12 GB card" table with the memory planner.

    python benchmarks/plan_12gb_table.py --gpu_memory 12GiB --effective_batch_size 32 > benchmarks/results/plan_12gb.md

Each row is `ft-accum plan` for one shipped config: the recommended split (the fastest predicted
to fit), for full fine-tuning (bf16 mixed precision, AdamW) and for LoRA r=16 (bf16 weights).
These are predictions from traced steps, not measurements.
"""

import argparse
import time

from ft_accum.errors import ConfigError
from ft_accum.memory_planner import plan

MODELS = [  # (shipped config, task, sequence length)
    ("bert-base-uncased", "text_classification", 256),
    ("gpt2-124m", "causal_lm", 1024),
    ("t5-base", "seq2seq", 512),
    ("qwen2.5-0.5b", "causal_lm", 1024),
    ("qwen2.5-1.5b", "causal_lm", 1024),
    ("llama-3.1-8b", "causal_lm", 1024),
]
MODES = {
    "full fine-tuning (bf16-mixed, AdamW)": {"precision": "bf16-mixed", "optimizer": "adamw"},
    "LoRA r=16 (bf16 weights)": {"precision": "bf16", "optimizer": "adamw", "lora_r": 16},
}


def cell(model, task, seq_len, settings, args):
    try:
        result = plan(
            model,
            task=task,
            seq_len=seq_len,
            effective_batch_size=args.effective_batch_size,
            gpu_memory_gib=args.gpu_memory,
            **settings,
        )
    except ConfigError as exc:
        return "does not fit: " + str(exc).split(";")[0].replace(
            "the weights and optimizer state alone need", "weights + optimizer state need"
        )
    best = result["recommended"]
    if best is None:
        return "does not fit at micro-batch 1"
    return (
        f"{best['per_device_train_batch_size']} × {best['gradient_accumulation_steps']}"
        + (", checkpointing" if best["gradient_checkpointing"] else "")
        + f" ({best['peak_gib']:.1f} GiB)"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu_memory", type=float, default=12.0, help="GiB")
    parser.add_argument("--effective_batch_size", type=int, default=32)
    args = parser.parse_args()
    print(f"| model | task, tokens | {' | '.join(MODES)} |")
    print("|---|---|" + "---|" * len(MODES))
    for model, task, seq_len in MODELS:
        started = time.perf_counter()
        cells = [cell(model, task, seq_len, settings, args) for settings in MODES.values()]
        print(f"| {model} | {task}, {seq_len} | {' | '.join(cells)} |", flush=True)
        print(f"<!-- {model}: {time.perf_counter() - started:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
