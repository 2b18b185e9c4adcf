"""python benchmarks/gpu_check.py [--dry_run]

Everything only a GPU can check, in one run of a few minutes on one GPU, printed as one table
(and saved to benchmarks/results/gpu_check.json):

1. mixed precision: recipes/text_classification.py at (8 × 1) against (2 × 4), 6 updates, through
   `accelerate launch` with accelerate_configs/single_gpu_bf16.yaml and single_gpu_fp16.yaml (and
   fp32 as the floor). The model is all-MiniLM-L6-v2's architecture and weights with dropout off,
   so the only difference is the split. Relative weight error against the chosen tolerances:
   fp32 1e-5 (the tests' bound), bf16 5e-2 and fp16 1e-2 (8 and 11 mantissa bits: a summation
   order changes the result at about 2^-8 and 2^-11 per operation, compounded over 6 updates).
2. memory planner: `ft_accum.memory_planner.trace_step` (fake tensors) against
   `torch.cuda.max_memory_allocated` of the same step (GPT-2-shaped, micro 4 × 256 tokens, AdamW),
   fp32 and bf16-mixed. Pass: within ±10%.
3. real OOM replan: the recipe at micro-batch 256 × 1 with --auto_micro_batch, under
   `torch.cuda.set_per_process_memory_fraction` set to 3× the peak of a micro-batch-8 run: it must
   hit a real CUDA OOM, halve until it fits, finish, and match a run started at the micro-batch it
   ended on (same effective batch 256) within the fp32 bound.
4. throughput against the Trainer: the recipe (bf16, `accelerate launch`) against
   `Trainer(bf16=True)`, MiniLM on BBC at 128 tokens, micro 32 × 4, 8 updates, 3 interleaved
   repeats, median per-update samples/s.

--dry_run runs checks 1 (fp32 only) and 4 on this machine's CPU with tiny settings, to test this
script without a GPU; it says nothing about GPUs.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from ft_accum.benchmarking import UpdateClock, launch_recipe, steady_rate, trainer_callback

ROOT = Path(__file__).resolve().parents[1]

TOLERANCE = {"no": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
CONFIGS = {"no": "cpu.yaml", "bf16": "single_gpu_bf16.yaml", "fp16": "single_gpu_fp16.yaml"}


def dropout_free_minilm(path: Path) -> Path:
    """The bundled MiniLM with dropout off: (8 × 1) and (2 × 4) then differ only in how the batch is split."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from ft_accum.offline_assets import bundled_minilm_dir

    source = bundled_minilm_dir()
    config = AutoConfig.from_pretrained(source, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    AutoModel.from_pretrained(source, config=config).save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def launch_with_config(config: str, args: list[str], output_dir: Path) -> dict:
    import subprocess

    from ft_accum.testing import launch_command

    cmd, env = launch_command(
        "text_classification", [*args, f"--output_dir={output_dir}", "--report_to=none"],
        config_file=ROOT / "accelerate_configs" / config,
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads((output_dir / "all_results.json").read_text())


def check_mixed_precision(model_dir: Path, precisions, updates: int, seq_len: int) -> list[dict]:
    from ft_accum.testing import final_weights, relative_error

    rows = []
    for precision in precisions:
        with tempfile.TemporaryDirectory() as out:
            common = [
                f"--model_name_or_path={model_dir}",
                f"--max_seq_length={seq_len}",
                f"--max_train_steps={updates}",
                "--max_eval_samples=16",
                "--learning_rate=1e-4",
                "--lr_scaling=none",
                "--weight_decay=0",
                "--num_warmup_steps=0",
                "--seed=42",
                f"--max_train_samples={8 * updates}",
            ]
            config = CONFIGS[precision] if torch.cuda.is_available() or precision == "no" else "cpu.yaml"
            launch_with_config(
                config,
                [*common, "--per_device_train_batch_size=8", "--gradient_accumulation_steps=1"],
                Path(out) / "full",
            )
            launch_with_config(
                config,
                [*common, "--per_device_train_batch_size=2", "--gradient_accumulation_steps=4"],
                Path(out) / "accumulated",
            )
            error = relative_error(final_weights(Path(out) / "accumulated"), final_weights(Path(out) / "full"))
        rows.append(
            {
                "check": f"(8 × 1) = (2 × 4), {precision if precision != 'no' else 'fp32'}",
                "measured": f"{error:.1e}",
                "bound": f"≤ {TOLERANCE[precision]:.0e}",
                "pass": error <= TOLERANCE[precision],
            }
        )
    return rows


def cuda_step(model, optimizer, batch, precision: str) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def check_planner() -> list[dict]:
    from transformers import GPT2Config

    from ft_accum.memory_planner import GIB, build_model, build_optimizer, example_batch, trace_step

    rows = []
    config = GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024)
    for precision in ("fp32", "bf16-mixed"):
        predicted = trace_step(config, micro_batch_size=4, task="causal_lm", seq_len=256, precision=precision).peak
        torch.manual_seed(0)
        model = build_model(config, "causal_lm").cuda()
        optimizer = build_optimizer("adamw", list(model.parameters()))
        batch = {k: v.cuda() for k, v in example_batch(config, "causal_lm", 4, 256).items()}

        cuda_step(
            model, optimizer, batch, precision
        )  # allocates the optimizer state, as the planner's steady state assumes
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_step(model, optimizer, batch, precision)
        measured = torch.cuda.max_memory_allocated()
        del model, optimizer, batch
        torch.cuda.empty_cache()
        rows.append(
            {
                "check": f"planner vs max_memory_allocated, GPT-2 124M, 4 × 256, {precision}",
                "measured": f"{predicted / GIB:.2f} vs {measured / GIB:.2f} GiB ({predicted / measured:.3f}×)",
                "bound": "0.90–1.10×",
                "pass": 0.9 <= predicted / measured <= 1.1,
            }
        )
    return rows


def check_oom_replan(model_dir: Path) -> list[dict]:
    from ft_accum.testing import final_weights, relative_error, run_in_process

    common = [
        f"--model_name_or_path={model_dir}",
        "--max_seq_length=128",
        "--max_train_steps=2",
        "--max_eval_samples=16",
        "--learning_rate=1e-4",
        "--lr_scaling=none",
        "--weight_decay=0",
        "--num_warmup_steps=0",
        "--seed=42",
        "--max_train_samples=512",
        "--report_to=none",
    ]
    with tempfile.TemporaryDirectory() as out:
        small = run_in_process(
            "text_classification",
            [
                *common,
                "--per_device_train_batch_size=8",
                "--gradient_accumulation_steps=1",
                f"--output_dir={out}/small",
            ],
        )
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, 3 * small["peak_memory_gb"] * 2**30 / total))
        auto = run_in_process(
            "text_classification",
            [
                *common,
                "--per_device_train_batch_size=256",
                "--gradient_accumulation_steps=1",
                "--auto_micro_batch",
                f"--output_dir={out}/auto",
            ],
        )
        torch.cuda.set_per_process_memory_fraction(1.0)
        micro = auto["per_device_train_batch_size"]
        run_in_process(
            "text_classification",
            [
                *common,
                f"--per_device_train_batch_size={micro}",
                f"--gradient_accumulation_steps={256 // micro}",
                f"--output_dir={out}/direct",
            ],
        )
        error = relative_error(final_weights(Path(out) / "auto"), final_weights(Path(out) / "direct"))
    return [
        {
            "check": f"real OOM at 256 × 1 → {micro} × {256 // micro}, same as a run started there",
            "measured": f"{error:.1e}",
            "bound": "≤ 1e-05, micro < 256",
            "pass": micro < 256 and error <= 1e-5,
        }
    ]


def trainer_rate(micro: int, accumulation: int, updates: int, seq_len: int, bf16: bool) -> float:
    from ft_accum.testing import load_script

    _bench_loop_overhead = load_script(ROOT / "benchmarks" / "bench_loop_overhead.py")
    load_inputs = _bench_loop_overhead.load_inputs
    from transformers import Trainer, TrainingArguments

    from ft_accum.offline_assets import bundled_minilm_dir

    model, collate, rows = load_inputs("classification", bundled_minilm_dir(), updates * micro * accumulation)
    clock = UpdateClock()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            max_steps=updates,
            learning_rate=1e-4,
            max_grad_norm=1.0,
            weight_decay=0.0,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            bf16=bf16,
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
        )
        Trainer(
            model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[trainer_callback(clock)]
        ).train()
    return steady_rate(clock.rates(micro * accumulation))


def check_throughput(micro: int, accumulation: int, updates: int, repeats: int, bf16: bool) -> list[dict]:
    import subprocess

    from accelerate.state import AcceleratorState, GradientState

    from ft_accum.testing import load_script

    bench_loop_overhead = load_script(ROOT / "benchmarks" / "bench_loop_overhead.py")

    ratios = []
    for _ in range(repeats):
        args = [
            "--per_device_train_batch_size",
            str(micro),
            "--gradient_accumulation_steps",
            str(accumulation),
            "--max_seq_length",
            str(bench_loop_overhead.SEQ_LEN),
            "--max_train_steps",
            str(updates),
            "--max_train_samples",
            str(updates * micro * accumulation),
            "--max_eval_samples",
            "8",
            "--learning_rate",
            "1e-4",
            "--lr_scaling",
            "none",
            "--weight_decay",
            "0",
            "--num_warmup_steps",
            "0",
        ]
        if bf16:
            with tempfile.TemporaryDirectory() as out:
                launch_with_config("single_gpu_bf16.yaml", args, Path(out))
                records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        else:
            records = launch_recipe("text_classification", args)[1]
        ours = steady_rate([r["samples_per_second"] for r in records])
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--trainer_rate",
                json.dumps([micro, accumulation, updates, bench_loop_overhead.SEQ_LEN, bf16]),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        ratios.append(ours / json.loads(proc.stdout.strip().splitlines()[-1]))
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    ratio = statistics.median(ratios)
    return [
        {
            "check": f"throughput recipe / Trainer, {'bf16' if bf16 else 'fp32'}, {micro} × {accumulation}",
            "measured": f"{ratio:.3f}× (per repeat {', '.join(f'{r:.2f}' for r in ratios)})",
            "bound": "≥ 1.0×",
            "pass": ratio >= 1.0,
        }
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="CPU, tiny settings, checks 1 (fp32) and 4 only: tests this script, not a GPU",
    )
    parser.add_argument("--trainer_rate", help=argparse.SUPPRESS)  # internal: one Trainer run in a fresh process
    args = parser.parse_args()
    if args.trainer_rate:
        print(json.dumps(trainer_rate(*json.loads(args.trainer_rate))))
        return
    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit(
            "error: no CUDA GPU here; gpu_check.py checks what only a GPU can (use --dry_run to test the script on CPU)"
        )
    rows = []
    with tempfile.TemporaryDirectory() as models:
        model_dir = dropout_free_minilm(Path(models) / "minilm-no-dropout")
        if args.dry_run:
            rows += check_mixed_precision(model_dir, ["no"], updates=2, seq_len=32)
            rows += check_throughput(micro=4, accumulation=2, updates=3, repeats=1, bf16=False)
        else:
            rows += check_mixed_precision(model_dir, ["no", "bf16", "fp16"], updates=6, seq_len=128)
            rows += check_planner()
            rows += check_oom_replan(model_dir)
            rows += check_throughput(micro=32, accumulation=4, updates=8, repeats=3, bf16=True)
    print(f"device: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU (dry run)'}\n")
    print("| check | measured | bound | result |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['check']} | {row['measured']} | {row['bound']} | {'pass' if row['pass'] else '**FAIL**'} |")
    if not args.dry_run:
        (ROOT / "benchmarks" / "results" / "gpu_check.json").write_text(json.dumps(rows, indent=2))
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


if __name__ == "__main__":
    main()
