"""python benchmarks/bench_loop_overhead.py [--task classification lm] [--accumulation 1 4 16] [--repeats 3] [--quick]

Loop overhead: the throughput of our recipes' training loops against the three loops a user would
otherwise run, on identical models, data and batch settings, at several accumulation steps:

- plain:      a hand-written PyTorch loop (`loss / N`, step every N micro-batches), no Accelerate;
- accelerate: Accelerate's `examples/by_feature/gradient_accumulation.py` loop
              (`Accelerator(gradient_accumulation_steps=N)`, `with accelerator.accumulate(model)`),
              plus clipping at 1.0 under `sync_gradients` so that its work equals the others';
- trainer:    `transformers.Trainer` with `gradient_accumulation_steps=N` (logging, saving, eval off);
- recipe:     recipes/text_classification.py or recipes/causal_lm.py through the real `accelerate launch`.

Workloads (fp32, one CPU process, AdamW, linear schedule, clipping at 1.0, micro-batch 8):
- classification: the bundled all-MiniLM-L6-v2 on BBC News, inputs cut to 64 tokens (all BBC
  articles are longer, so every micro-batch has the same shape); samples/s.
- lm: a 4-layer, 256-wide GPT-2 built from a config with the SmolLM2 tokenizer (49k vocabulary),
  packed 64-token BBC blocks; target tokens/s.
Every run does the same number of micro-batches (48), so accumulation 16 is 3 updates.

Each run is a fresh process; the variants are interleaved within a repeat, each repeat starting
with the next variant (plain, accelerate, trainer, recipe; then accelerate, trainer, recipe, plain;
...), and each run's figure is its median per-update rate, warm-up update
left out (ft_accum/testing/benchmarking.py). Reported: the median over repeats and the median of the
per-repeat ratios to the plain loop. --quick runs tiny models in this process, once: a smoke test of
the code, not a measurement.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ft_accum.testing import reset_accelerate_state
from ft_accum.testing.benchmarking import (
    UpdateClock,
    plain_accumulation_loop,
    run_recipe,
    steady_rate,
    summarize,
    trainer_callback,
)

ROOT = Path(__file__).resolve().parents[1]

MICRO, SEQ_LEN, SEED = 8, 64, 42
LEARNING_RATE = {"classification": 1e-4, "lm": 1e-3}
UNIT = {"classification": "samples/s", "lm": "tokens/s"}
VARIANTS = ("plain", "accelerate", "trainer", "recipe")


def build_model_dir(task: str, quick: bool, path: Path) -> Path:
    """The model every variant loads: the bundled MiniLM (classification), or a GPT-2 from a config."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from ft_accum.data.offline_assets import bundled_minilm_dir, bundled_smollm2_dir

    if task == "classification":
        if not quick:
            return bundled_minilm_dir()
        tokenizer = AutoTokenizer.from_pretrained(bundled_minilm_dir())
        config = AutoConfig.from_pretrained(
            bundled_minilm_dir(),
            num_hidden_layers=1,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=5,
        )
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        tokenizer = AutoTokenizer.from_pretrained(bundled_smollm2_dir())
        width, layers = (32, 1) if quick else (256, 4)
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=width,
            n_layer=layers,
            n_head=4,
            n_positions=SEQ_LEN,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = GPT2LMHeadModel(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def items_per_update(task: str, accumulation: int) -> int:
    return MICRO * accumulation * (SEQ_LEN - 1 if task == "lm" else 1)  # LM: target tokens, after the causal shift


def load_inputs(task: str, model_dir: Path, num_rows: int):
    """Model, collator and rows, the same for plain, accelerate and trainer."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        default_data_collator,
    )

    from ft_accum.data.offline_assets import load_bbc_news

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = load_bbc_news(seed=SEED)["train"]
    if task == "classification":
        rows = texts.select(range(num_rows)).map(
            lambda r: tokenizer(r["text"], truncation=True, max_length=SEQ_LEN), batched=True, remove_columns=["text"]
        )
        return (
            AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=5),
            DataCollatorWithPadding(tokenizer),
            rows.rename_column("label", "labels"),
        )
    ids = []
    for text in texts["text"]:
        ids += tokenizer(text + tokenizer.eos_token)["input_ids"]
        if len(ids) >= num_rows * SEQ_LEN:
            break
    rows = [
        {
            "input_ids": ids[i * SEQ_LEN : (i + 1) * SEQ_LEN],
            "attention_mask": [1] * SEQ_LEN,
            "labels": ids[i * SEQ_LEN : (i + 1) * SEQ_LEN],
        }
        for i in range(num_rows)
    ]
    return AutoModelForCausalLM.from_pretrained(model_dir), default_data_collator, rows


def run_plain(task, model_dir, accumulation, updates):
    import torch
    from torch.utils.data import DataLoader

    torch.manual_seed(SEED)
    model, collate, rows = load_inputs(task, model_dir, updates * MICRO * accumulation)
    loader = DataLoader(rows, batch_size=MICRO, shuffle=True, collate_fn=collate)
    return plain_accumulation_loop(model, loader, updates, accumulation, LEARNING_RATE[task])


def run_accelerate(task, model_dir, accumulation, updates):
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    torch.manual_seed(SEED)
    model, collate, rows = load_inputs(task, model_dir, updates * MICRO * accumulation)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE[task], fused=True
    )  # as the recipes and the Trainer
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=updates)
    loader = DataLoader(rows, batch_size=MICRO, shuffle=True, collate_fn=collate)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    clock = UpdateClock()
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            clock.tick()
    reset_accelerate_state()
    return clock


def run_trainer(task, model_dir, accumulation, updates):
    import torch
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(SEED)
    model, collate, rows = load_inputs(task, model_dir, updates * MICRO * accumulation)
    clock = UpdateClock()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=accumulation,
            max_steps=updates,
            learning_rate=LEARNING_RATE[task],
            lr_scheduler_type="linear",
            max_grad_norm=1.0,
            weight_decay=0.0,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            seed=SEED,
            disable_tqdm=True,
        )
        Trainer(
            model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[trainer_callback(clock)]
        ).train()
    reset_accelerate_state()
    return clock


def recipe_args(task, model_dir, accumulation, updates):
    common = [
        "--model_name_or_path",
        str(model_dir),
        "--per_device_train_batch_size",
        str(MICRO),
        "--gradient_accumulation_steps",
        str(accumulation),
        "--learning_rate",
        str(LEARNING_RATE[task]),
        "--lr_scaling",
        "none",
        "--num_warmup_steps",
        "0",
        "--weight_decay",
        "0",
        "--max_train_steps",
        str(updates),
        "--num_train_epochs",
        "1",
        "--seed",
        str(SEED),
    ]
    if task == "classification":
        return "text_classification", [
            *common,
            "--max_seq_length",
            str(SEQ_LEN),
            "--max_train_samples",
            str(updates * MICRO * accumulation),
            "--max_eval_samples",
            "8",
        ]
    # BBC articles give ~8 blocks of 64 tokens each; a margin of documents so the run never runs short.
    documents = max(24, updates * MICRO * accumulation // 4)
    return "causal_lm", [
        *common,
        "--packing",
        "--block_size",
        str(SEQ_LEN),
        "--max_train_samples",
        str(documents),
        "--max_eval_samples",
        "2",
    ]


def run_variant(name, task, model_dir, accumulation, updates, in_process=False) -> float:
    """One run; returns its steady per-update rate (samples/s or target tokens/s)."""
    key = "tokens_per_second" if task == "lm" else "samples_per_second"
    if name == "recipe":
        recipe, args = recipe_args(task, model_dir, accumulation, updates)
        return steady_rate([r[key] for r in run_recipe(recipe, args, in_process)[1]])
    if in_process:
        clock = {"plain": run_plain, "accelerate": run_accelerate, "trainer": run_trainer}[name](
            task, model_dir, accumulation, updates
        )
        return steady_rate(clock.rates(items_per_update(task, accumulation)))
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--variant",
            name,
            "--task",
            task,
            "--accumulation",
            str(accumulation),
            "--updates",
            str(updates),
            "--model_dir",
            str(model_dir),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])["rate"]


def measure(
    tasks=("classification", "lm"), accumulations=(1, 4, 16), repeats=3, quick=False, micro_batches=48
) -> dict:
    """All tasks × accumulations × variants, interleaved; the JSON that run_all.py turns into a table."""
    results = {
        "setup": {
            "micro_batch": MICRO,
            "seq_len": SEQ_LEN,
            "micro_batches_per_run": micro_batches,
            "repeats": repeats,
            "quick": quick,
            "precision": "fp32",
            "device": "cpu",
            "processes": 1,
        },
        "tables": [],
    }
    with tempfile.TemporaryDirectory() as models:
        for task in tasks:
            model_dir = build_model_dir(task, quick, Path(models) / task)
            for accumulation in accumulations:
                updates = max(3, micro_batches // accumulation)
                runs = {name: [] for name in VARIANTS}
                for repeat in range(repeats):
                    # Each repeat starts with the next variant, so no variant always runs first (or right after a recipe's save).
                    for name in VARIANTS[repeat % len(VARIANTS) :] + VARIANTS[: repeat % len(VARIANTS)]:
                        rate = run_variant(name, task, model_dir, accumulation, updates, in_process=quick)
                        runs[name].append({"rate": rate})
                        print(
                            f"{task} accumulation {accumulation} repeat {repeat + 1}/{repeats} {name}: {rate:.1f} {UNIT[task]}",
                            file=sys.stderr,
                        )
                stats = summarize(runs, "rate")
                results["tables"].append(
                    {
                        "task": task,
                        "unit": UNIT[task],
                        "accumulation": accumulation,
                        "updates": updates,
                        "runs": runs,
                        "median": stats["median"],
                        "ratio_to_plain": stats["ratio_to_plain"],
                        "per_repeat_ratios": stats["per_repeat_ratios"],
                    }
                )
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", nargs="+", choices=["classification", "lm"], default=["classification", "lm"])
    parser.add_argument("--accumulation", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny models, one repeat, in this process: a smoke test, not a measurement",
    )
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "loop_overhead.json")
    parser.add_argument(
        "--variant", choices=VARIANTS[:3], help=argparse.SUPPRESS
    )  # internal: one run in this fresh process
    parser.add_argument("--updates", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model_dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        clock = {"plain": run_plain, "accelerate": run_accelerate, "trainer": run_trainer}[args.variant](
            args.task[0], args.model_dir, args.accumulation[0], args.updates
        )
        print(json.dumps({"rate": steady_rate(clock.rates(items_per_update(args.task[0], args.accumulation[0])))}))
        return
    results = measure(
        args.task, args.accumulation, 1 if args.quick else args.repeats, args.quick, 6 if args.quick else 48
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
