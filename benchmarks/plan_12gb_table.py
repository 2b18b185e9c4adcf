"""Generate the README's "what fits on a 12 GB card" table with the memory planner.

    python benchmarks/plan_12gb_table.py --gpu_memory 12 --effective_batch_size 32 > benchmarks/results/plan_12gb.md

Each row is `ft-accum plan` for one shipped config: the recommended split (the fastest predicted
to fit), for full fine-tuning (bf16 mixed precision, fp32 master weights, fused AdamW), low-memory
full fine-tuning (bf16 weights, bitsandbytes' 8-bit AdamW), LoRA r=16 (bf16 frozen base) and
QLoRA r=16 (NF4 frozen base, bf16 embeddings and head). The cells also go to benchmarks/results/plan_12gb.json, from which
benchmarks/gpu_check.py runs each one on a GPU under an 11.4 GiB cap; a cell that such a run
verified (benchmarks/results/gpu_check.json) says "verified on GPU", every other "predicted".
"""

import argparse
import json
import time
from pathlib import Path

from ft_accum.core.errors import ConfigError
from ft_accum.planner.memory_planner import plan

MODELS = [  # (shipped config, task, sequence length)
    ("bert-base-uncased", "text_classification", 256),
    ("gpt2-124m", "causal_lm", 1024),
    ("t5-base", "seq2seq", 512),
    ("qwen2.5-0.5b", "causal_lm", 1024),
    ("qwen2.5-1.5b", "causal_lm", 1024),
    ("llama-3.1-8b", "causal_lm", 1024),
    # Preference tuning (recipes/preference_tuning.py): the batch counts pairs, each two sequences of
    # 512 tokens (prompt + response); full fine-tuning keeps DPO's frozen reference copy.
    ("qwen2.5-0.5b", "preference", 512),
    ("qwen2.5-1.5b", "preference", 512),
    ("llama-3.1-8b", "preference", 512),
]
MODES = {
    "full fine-tuning (bf16-mixed, fp32 weights, AdamW)": {"precision": "bf16-mixed", "optimizer": "adamw"},
    "full fine-tuning, low memory (bf16 weights, 8-bit AdamW)": {"precision": "bf16", "optimizer": "adamw_8bit"},
    "LoRA r=16 (bf16 frozen base)": {"precision": "bf16", "optimizer": "adamw", "lora_r": 16},
    "QLoRA r=16 (NF4 frozen base)": {"precision": "bf16", "optimizer": "adamw", "lora_r": 16, "load_in_4bit": True},
}


def mode_key(settings: dict) -> str:
    """The cell's mode in its key: full, full-8bit, lora or qlora."""
    if settings.get("load_in_4bit"):
        return "qlora"
    if settings.get("lora_r"):
        return "lora"
    return "full-8bit" if settings.get("optimizer") == "adamw_8bit" else "full"


ROOT = Path(__file__).resolve().parents[1]


def verified_cells() -> dict[str, dict]:
    """The cells a GPU run of gpu_check.py finished under the cap, by their key."""
    path = ROOT / "benchmarks" / "results" / "gpu_check.json"
    rows = json.loads(path.read_text())["rows"] if path.is_file() else []
    return {r["cell"]: r for r in rows if r.get("cell") and r["pass"]}


def cell(model, task, seq_len, settings, args):
    """(the table's text, the cell's record for plan_12gb.json or None)."""
    if settings.get("load_in_4bit") and task not in ("causal_lm", "preference"):
        return "— (4-bit: the LM recipes)", None
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
        text = (
            str(exc)
            .split(";")[0]
            .replace("the weights and optimizer state alone need", "weights + optimizer state need")
        )
        return "does not fit: " + text, None
    best = result["recommended"]
    if best is None:
        return "does not fit at micro-batch 1", None
    record = {
        "cell": f"{model} {task} {seq_len} {mode_key(settings)}",
        "model": model,
        "task": task,
        "seq_len": seq_len,
        **settings,
        "effective_batch_size": args.effective_batch_size,
        "per_device_train_batch_size": best["per_device_train_batch_size"],
        "gradient_accumulation_steps": best["gradient_accumulation_steps"],
        "gradient_checkpointing": best["gradient_checkpointing"],
        "predicted_gib": best["peak_gib"],
    }
    if task == "preference":  # gpu_check.py runs the other recipes' cells; it has no preference runner yet
        record = None
    verified = verified_cells().get(record["cell"]) if record else None
    mark = f"verified on GPU, {verified['measured_gib']:.1f} GiB" if verified else "predicted"
    text = (
        f"{best['per_device_train_batch_size']} × {best['gradient_accumulation_steps']}"
        + (", checkpointing" if best["gradient_checkpointing"] else "")
        + f" ({best['peak_gib']:.1f} GiB, {mark})"
    )
    return text, record


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu_memory", type=float, default=12.0, help="GiB")
    parser.add_argument("--effective_batch_size", type=int, default=32)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "plan_12gb.json")
    parser.add_argument("--task", default=None, help="only the rows of this task (the JSON is then not written)")
    args = parser.parse_args()
    print(f"| model | task, tokens | {' | '.join(MODES)} |")
    print("|---|---|" + "---|" * len(MODES))
    records = []
    for model, task, seq_len in MODELS:
        if args.task and task != args.task:
            continue
        started = time.perf_counter()
        cells = [cell(model, task, seq_len, settings, args) for settings in MODES.values()]
        records += [record for _, record in cells if record]
        print(f"| {model} | {task}, {seq_len} | {' | '.join(text for text, _ in cells)} |", flush=True)
        print(f"<!-- {model}: {time.perf_counter() - started:.0f} s -->", flush=True)
    if not args.task:
        args.json.write_text(json.dumps({"gpu_memory_gib": args.gpu_memory, "cells": records}, indent=2))


if __name__ == "__main__":
    main()
