"""GPU check 4: tokens per second and peak of a plain PyTorch loop, the Transformers Trainer and the
causal-LM recipe, like for like; then the recipe with --torch_compile, --offload_activations and
--gradient_checkpointing, reported.
"""

import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ft_accum.testing.gpu_checks.common import (
    cuda_peak_gib,
    packed_rows,
    random_model_dir,
    run_recipe,
    shrink_for_dry_run,
    timed_rates,
)


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
