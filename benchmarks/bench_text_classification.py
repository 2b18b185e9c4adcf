"""python benchmarks/bench_text_classification.py [--updates 8] [--repeats 3]

Throughput of recipes/text_classification.py against the two real alternatives, on identical
work in one run: all-MiniLM-L6-v2 on BBC News, max_seq_length 128, micro-batch 8 × accumulation 4
(32 samples per update), AdamW, linear schedule, clipping at 1.0, fp32, one process.

- plain:   a hand-written PyTorch loop (loss / N, step every N micro-batches), no Accelerate.
- trainer: transformers.Trainer with the same batch settings.
- recipe:  the recipe, through the real `accelerate launch`.

Each variant runs in its own process (so peak RSS is its own), the variants are interleaved, and
each run's throughput is its median per-update samples/s, warm-up update excluded (see
benchmarks/timing.py). The report gives the median over repeats and the median of the per-repeat
ratios to the plain loop. Model loading and evaluation are not timed.
Results go to benchmarks/results/text_classification.json and a Markdown table on stdout.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from timing import UpdateClock, plain_accumulation_loop, steady_rate, summarize, trainer_callback  # noqa: E402

MICRO, ACCUMULATION, SEQ_LEN, LR, SEED = 8, 4, 128, 1e-4, 42


def load_inputs(num_samples):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ft_accum.offline_assets import bundled_minilm_dir, load_bbc_news

    path = bundled_minilm_dir()
    train = load_bbc_news(seed=SEED)["train"].select(range(num_samples))
    tokenizer = AutoTokenizer.from_pretrained(path)
    train = train.map(
        lambda rows: tokenizer(rows["text"], truncation=True, max_length=SEQ_LEN),
        batched=True,
        remove_columns=["text"],
    )
    train = train.rename_column("label", "labels")
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=5)
    return model, tokenizer, train


def run_plain(updates):
    import torch
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding

    from ft_accum.memory import peak_memory_gb

    torch.manual_seed(SEED)
    model, tokenizer, train = load_inputs(updates * MICRO * ACCUMULATION)
    loader = DataLoader(train, batch_size=MICRO, shuffle=True, collate_fn=DataCollatorWithPadding(tokenizer))
    clock = plain_accumulation_loop(model, loader, updates, ACCUMULATION, LR)
    return {
        "samples_per_second": steady_rate(clock.rates(MICRO * ACCUMULATION)),
        "peak_memory_gb": peak_memory_gb(torch.device("cpu")),
    }


def run_trainer(updates):
    import torch
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    from ft_accum.memory import peak_memory_gb

    torch.manual_seed(SEED)
    model, tokenizer, train = load_inputs(updates * MICRO * ACCUMULATION)

    clock = UpdateClock()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=ACCUMULATION,
            max_steps=updates,
            learning_rate=LR,
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
            model=model,
            args=args,
            train_dataset=train,
            data_collator=DataCollatorWithPadding(tokenizer),
            callbacks=[trainer_callback(clock)],
        ).train()
    return {
        "samples_per_second": steady_rate(clock.rates(MICRO * ACCUMULATION)),
        "peak_memory_gb": peak_memory_gb(torch.device("cpu")),
    }


def run_recipe(updates):
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / "cpu.yaml"),
            str(ROOT / "recipes" / "text_classification.py"),
            "--per_device_train_batch_size",
            str(MICRO),
            "--gradient_accumulation_steps",
            str(ACCUMULATION),
            "--max_seq_length",
            str(SEQ_LEN),
            "--learning_rate",
            str(LR),
            "--weight_decay",
            "0",
            "--max_train_samples",
            str(updates * MICRO * ACCUMULATION),
            "--max_eval_samples",
            "8",
            "--num_train_epochs",
            "1",
            "--seed",
            str(SEED),
            "--output_dir",
            out,
            "--report_to",
            "none",
        ]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        results = json.loads((Path(out) / "all_results.json").read_text())
        rates = [
            json.loads(line)["samples_per_second"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()
        ]
    return {"samples_per_second": steady_rate(rates), "peak_memory_gb": results["peak_memory_gb"]}


VARIANTS = {"plain": run_plain, "trainer": run_trainer, "recipe": run_recipe}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=8, help="optimizer updates per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (median reported)")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: run one variant here
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(VARIANTS[args.variant](args.updates)))
        return

    runs = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        for name in VARIANTS:
            if name == "recipe":
                result = run_recipe(args.updates)
            else:
                proc = subprocess.run(
                    [sys.executable, __file__, "--variant", name, "--updates", str(args.updates)],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[name].append(result)
            print(
                f"repeat {repeat + 1}/{args.repeats} {name}: {result['samples_per_second']:.2f} samples/s, peak {result['peak_memory_gb']:.2f} GiB",
                file=sys.stderr,
            )

    stats = summarize(runs, "samples_per_second")
    summary = {
        "setup": {
            "model": "all-MiniLM-L6-v2",
            "data": "BBC News",
            "micro_batch": MICRO,
            "gradient_accumulation_steps": ACCUMULATION,
            "max_seq_length": SEQ_LEN,
            "updates": args.updates,
            "repeats": args.repeats,
            "precision": "fp32",
            "device": "cpu",
        },
        "runs": runs,
        "median_samples_per_second": stats["median"],
        "ratio_to_plain": stats["ratio_to_plain"],
        "per_repeat_ratios": stats["per_repeat_ratios"],
        "peak_memory_gb": {name: max(r["peak_memory_gb"] for r in rs) for name, rs in runs.items()},
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "text_classification.json").write_text(json.dumps(summary, indent=2))
    print(
        "| variant | median samples/s | ratio to plain loop (median of repeats) | per-repeat ratios | peak RSS (GiB) |\n|---|---|---|---|---|"
    )
    for name in VARIANTS:
        ratios = ", ".join(f"{r:.3f}" for r in stats["per_repeat_ratios"][name])
        print(
            f"| {name} | {stats['median'][name]:.2f} | {stats['ratio_to_plain'][name]:.3f} | {ratios} | {summary['peak_memory_gb'][name]:.2f} |"
        )


if __name__ == "__main__":
    main()
