"""python benchmarks/bench_time_to_accuracy.py [--seeds 42 43 44] [--train_samples 2048] [--quick]

Time to accuracy on real data: SST-2 (GLUE, binary sentiment) from ../shared/data/sst2, skipped with
a note when that folder is absent. The bundled all-MiniLM-L6-v2, inputs cut to 64 tokens, the first
2,048 training sentences for one epoch, the 872 dev sentences for accuracy. AdamW, linear decay with
warmup over the first 1/16 of the updates, weight decay 0.01, clipping at 1.0, fp32, one CPU process.

Contenders, interleaved within each seed (each seed is one repeat, starting with the next contender):
- ours, 8 × 4:      recipes/text_classification.py through `accelerate launch`, effective batch 32;
- Trainer, 8 × 4:   transformers.Trainer with the same model, data, batch and hyperparameters;
- ours, 32 × 4 = 128, with --lr_scaling none, linear and sqrt from the batch-32 learning rate:
  the same samples in a quarter of the updates, so the value of each LR policy is measured.

The batch-32 learning rate is tuned first: ours at 8 × 4 with 5e-5, 1e-4 and 2e-4 on the first
seed, the best dev accuracy wins (dev is also where the table's accuracy comes from, so the tuned
row is optimistic by construction; the policies start from that same LR). Wall time is the whole
command (start-up, tokenization, training, evaluation), measured around each process.
--quick: a tiny BERT from a config, 64 sentences, one seed, no tuning.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ft_accum.testing import reset_accelerate_state
from ft_accum.testing.benchmarking import run_recipe

ROOT = Path(__file__).resolve().parents[1]
SST2 = ROOT.parent / "shared" / "data" / "sst2"

MICRO, ACCUMULATION, SEQ_LEN = 8, 4, 64
TUNING_GRID = (5e-5, 1e-4, 2e-4)


def hyperparameters(updates: int) -> dict:
    return {"weight_decay": 0.01, "max_grad_norm": 1.0, "num_warmup_steps": max(1, updates // 16)}


def run_ours(model_dir, train_samples, seed, learning_rate, micro, effective, lr_scaling="none", quick=False) -> dict:
    updates = train_samples // effective
    hp = hyperparameters(updates)
    args = [
        f"--model_name_or_path={model_dir}",
        f"--train_file={SST2 / 'train.tsv'}",
        f"--validation_file={SST2 / 'dev.tsv'}",
        "--text_column=sentence",
        "--label_column=label",
        f"--max_seq_length={SEQ_LEN}",
        f"--max_train_samples={train_samples}",
        f"--per_device_train_batch_size={micro}",
        f"--effective_batch_size={effective}",
        f"--learning_rate={learning_rate}",
        "--base_batch_size=32",
        f"--lr_scaling={lr_scaling}",
        "--lr_scheduler_type=linear",
        f"--num_warmup_steps={hp['num_warmup_steps']}",
        f"--weight_decay={hp['weight_decay']}",
        f"--max_grad_norm={hp['max_grad_norm']}",
        "--num_train_epochs=1",
        "--per_device_eval_batch_size=64",
        f"--seed={seed}",
    ] + (["--max_eval_samples=32"] if quick else [])
    started = time.perf_counter()
    results = run_recipe("text_classification", args, in_process=quick)[0]
    return {
        "accuracy": results["eval_accuracy"],
        "updates": results["num_update_steps"],
        "wall_seconds": time.perf_counter() - started,
        "train_seconds": results["train_runtime"],
        "learning_rate": results.get("learning_rate"),
    }


def trainer_run(model_dir, train_samples, seed, learning_rate, quick=False) -> dict:
    """transformers.Trainer at 8 × 4 on the same rows and hyperparameters (run in its own process)."""
    import datasets
    import numpy as np
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    raw = datasets.load_dataset(
        "csv", data_files={"train": str(SST2 / "train.tsv"), "validation": str(SST2 / "dev.tsv")}, delimiter="\t"
    )
    raw["train"] = raw["train"].select(range(train_samples))
    if quick:
        raw["validation"] = raw["validation"].select(range(32))
    data = raw.map(
        lambda r: tokenizer(r["sentence"], truncation=True, max_length=SEQ_LEN),
        batched=True,
        remove_columns=["sentence"],
    )
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=2, ignore_mismatched_sizes=True
    )  # as the recipe loads it
    hp = hyperparameters(train_samples // (MICRO * ACCUMULATION))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=ACCUMULATION,
            per_device_eval_batch_size=64,
            learning_rate=learning_rate,
            lr_scheduler_type="linear",
            warmup_steps=hp["num_warmup_steps"],
            weight_decay=hp["weight_decay"],
            max_grad_norm=hp["max_grad_norm"],
            num_train_epochs=1,
            seed=seed,
            data_seed=seed,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            eval_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=data["train"], data_collator=DataCollatorWithPadding(tokenizer)
        )
        train_output = trainer.train()
        prediction = trainer.predict(data["validation"])
    accuracy = float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())
    return {
        "accuracy": accuracy,
        "updates": train_output.global_step,
        "train_seconds": train_output.metrics["train_runtime"],
    }


def run_trainer(model_dir, train_samples, seed, learning_rate, quick=False) -> dict:
    started = time.perf_counter()
    if quick:
        result = trainer_run(model_dir, train_samples, seed, learning_rate, quick=True)
        reset_accelerate_state()
    else:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--trainer_run",
                json.dumps([str(model_dir), train_samples, seed, learning_rate]),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "wall_seconds": time.perf_counter() - started}


def measure(seeds=(42, 43, 44), train_samples=2048, quick=False) -> dict:
    if not (SST2 / "train.tsv").exists():
        return {"skipped": f"{SST2} not found: SST-2 is shared material beside the project, not part of it"}
    from ft_accum.data.offline_assets import bundled_minilm_dir

    with tempfile.TemporaryDirectory() as models:
        model_dir = bundled_minilm_dir()
        if quick:
            from ft_accum.testing import load_script

            _bench_loop_overhead = load_script(ROOT / "benchmarks" / "bench_loop_overhead.py")
            build_model_dir = _bench_loop_overhead.build_model_dir

            model_dir = build_model_dir("classification", True, Path(models) / "tiny")
            seeds, train_samples = seeds[:1], 64
        tuning = {}
        if not quick:
            for learning_rate in TUNING_GRID:
                tuning[learning_rate] = run_ours(model_dir, train_samples, seeds[0], learning_rate, MICRO, 32)
                print(f"tuning lr {learning_rate}: accuracy {tuning[learning_rate]['accuracy']:.4f}", file=sys.stderr)
        big_micro, big = (8, 64) if quick else (32, 128)
        base_lr = max(tuning, key=lambda lr: tuning[lr]["accuracy"]) if tuning else 1e-4
        contenders = {
            "ours, 8 × 4 = 32": lambda seed: run_ours(model_dir, train_samples, seed, base_lr, MICRO, 32, quick=quick),
            "Trainer, 8 × 4 = 32": lambda seed: run_trainer(model_dir, train_samples, seed, base_lr, quick=quick),
            **{
                f"ours, {big_micro} × {big // big_micro} = {big}, lr_scaling {policy}": (
                    lambda seed, policy=policy: run_ours(
                        model_dir, train_samples, seed, base_lr, big_micro, big, policy, quick=quick
                    )
                )
                for policy in ("none", "linear", "sqrt")
            },
        }
        runs = {name: [] for name in contenders}
        for i, seed in enumerate(seeds):
            names = list(contenders)
            for name in names[i % len(names) :] + names[: i % len(names)]:  # each seed starts with the next contender
                run = contenders[name]
                result = run(seed)
                runs[name].append({"seed": seed, **result})
                print(
                    f"seed {seed} {name}: accuracy {result['accuracy']:.4f}, {result['wall_seconds']:.0f} s",
                    file=sys.stderr,
                )
    summary = {
        name: {
            key: statistics.median(r[key] for r in rs)
            for key in ("accuracy", "wall_seconds", "train_seconds", "updates")
        }
        for name, rs in runs.items()
    }
    return {
        "setup": {
            "data": "SST-2 (GLUE)",
            "train_samples": train_samples,
            "dev_samples": 32 if quick else 872,
            "model": "tiny BERT (quick)" if quick else "all-MiniLM-L6-v2",
            "max_seq_length": SEQ_LEN,
            "seeds": list(seeds),
            "quick": quick,
            "precision": "fp32",
            "device": "cpu",
        },
        "tuning": {str(lr): r for lr, r in tuning.items()},
        "base_learning_rate": base_lr,
        "runs": runs,
        "median": summary,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 43, 44])
    parser.add_argument("--train_samples", type=int, default=2048)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "time_to_accuracy.json")
    parser.add_argument("--trainer_run", help=argparse.SUPPRESS)  # internal: one Trainer run in this fresh process
    args = parser.parse_args()
    if args.trainer_run:
        print(json.dumps(trainer_run(*json.loads(args.trainer_run))))
        return
    results = measure(tuple(args.seeds), args.train_samples, args.quick)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
