"""Benchmark helpers: throughput from per-update timings, the plain loop, the recipe runners.

A whole-run average on a shared 2-core VM moves by ±10% between runs (steal time, background
load), more than the differences we want to see. Each run therefore records the wall time of
every optimizer update, and its throughput is the median over updates with the first (warm-up)
left out; the report gives the median over repeats and the median of the per-repeat ratios
(variants run back to back within a repeat, so a ratio compares like with like).
"""

import contextlib
import statistics
import time
from pathlib import Path


def now() -> float:
    """perf_counter once the GPU has finished its queued work (CUDA runs asynchronously)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class UpdateClock:
    """Call `tick()` after each optimizer update; `rates(n)` gives n / seconds for each update."""

    def __init__(self):
        self.stamps = [now()]

    def restart(self):
        self.stamps = [now()]

    def tick(self):
        self.stamps.append(now())

    def rates(self, items_per_update: float) -> list[float]:
        return [items_per_update / (b - a) for a, b in zip(self.stamps, self.stamps[1:])]


@contextlib.contextmanager
def timed_generation_rounds():
    """Times each call of `generation_round.generate_round` (GRPO's round) while the block runs:
    yields a list that gets, per round, its seconds (`now`: the GPU's queued work included), its
    completions and their tokens."""
    from ft_accum.training import generation_round

    rounds: list[dict] = []
    generate_round = generation_round.generate_round

    def timed(*args, **kwargs):
        started = now()
        completions = generate_round(*args, **kwargs)
        rounds.append({"seconds": now() - started, "completions": len(completions),
                       "completion_tokens": sum(len(c.completion_ids) for c in completions)})  # fmt: skip
        return completions

    generation_round.generate_round = timed
    try:
        yield rounds
    finally:
        generation_round.generate_round = generate_round


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of an optimizer's per-parameter state tensors, as stored: torchao's quantized states are
    tensor subclasses whose inner tensors are counted; bitsandbytes' `qmap` code books are one
    shared tensor and are left out; scalar `step` counters too."""
    import torch

    total = 0
    for state in getattr(optimizer, "optimizer", optimizer).state.values():
        for key, value in state.items():
            if not torch.is_tensor(value) or not value.dim() or key.startswith("qmap"):
                continue
            names = value.__tensor_flatten__()[0] if hasattr(value, "__tensor_flatten__") else []
            inner = [getattr(value, name) for name in names]
            total += sum(t.numel() * t.element_size() for t in inner) or value.numel() * value.element_size()
    return total


def steady_rate(rates: list[float], warmup: int = 1) -> float:
    """Median per-update rate, the first `warmup` updates (allocations, first-call overheads; on a GPU also
    the allocator's and cuBLAS's first calls: 2) left out while more than `warmup` + 1 remain. The one
    definition of a steady rate in the benchmarks."""
    return statistics.median(rates[warmup:] if len(rates) > warmup + 1 else rates)


def repeats_main(measure, description: str, default_output: Path) -> None:
    """The command line of a benchmark that `measure(repeats, quick)`s: `--repeats N` (1 with `--quick`),
    its JSON to `--output` (default `default_output`)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=default_output)
    args = parser.parse_args()
    results = measure(1 if args.quick else args.repeats, args.quick)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))


def trainer_callback(clock: UpdateClock):
    """A TrainerCallback that ticks `clock` at every optimizer update of the Trainer."""
    from transformers import TrainerCallback

    class Ticks(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            clock.restart()

        def on_step_end(self, *args, **kwargs):
            clock.tick()

    return Ticks()


def summarize(runs: dict[str, list[dict]], key: str, baseline: str = "plain") -> dict:
    """Median rate per variant over repeats, and the median of per-repeat ratios to the baseline."""
    median = {name: statistics.median(r[key] for r in rs) for name, rs in runs.items()}
    ratios = {name: [a[key] / b[key] for a, b in zip(rs, runs[baseline])] for name, rs in runs.items()}
    return {
        "median": median,
        "ratio_to_plain": {n: statistics.median(r) for n, r in ratios.items()},
        "per_repeat_ratios": ratios,
    }


def plain_accumulation_loop(
    model, loader, updates: int, accumulation: int, learning_rate: float, autocast_dtype=None
) -> UpdateClock:
    """The baseline every benchmark compares against: the tutorial loop (`loss / N`, step every N
    micro-batches), AdamW on the trainable parameters without weight decay (as the recipes and the
    Trainer are run beside it), a linear schedule, clipping at 1.0. The batches go to the model's
    device; `autocast_dtype` (bf16 on a GPU) runs the forward under autocast."""
    import contextlib

    import torch
    from transformers import get_scheduler

    # fused: what the recipes and the Trainer use, so that only the loop differs between contenders (issue 16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=learning_rate, weight_decay=0.0, fused=True)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=updates)
    device = trainable[0].device
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    model.train()
    clock = UpdateClock()
    for i, batch in enumerate(loader):
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast:
            loss = model(**batch).loss
        (loss / accumulation).backward()
        if (i + 1) % accumulation == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            clock.tick()
    return clock


def launch_recipe(recipe: str, args: list[str], num_processes: int = 1) -> tuple[dict, list[dict]]:
    """Run recipes/<recipe>.py through the real `accelerate launch` (1 CPU process, or N over gloo) in a
    temporary output_dir; return its all_results.json and metrics.jsonl records."""
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    from ft_accum.testing import ROOT as root
    from ft_accum.testing import launch_command

    with tempfile.TemporaryDirectory() as out:
        cmd, env = launch_command(recipe, [*args, "--output_dir", out, "--report_to", "none"], num_processes)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{recipe} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        results = json.loads((Path(out) / "all_results.json").read_text())
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return results, records


def run_recipe(recipe: str, args: list[str], in_process: bool = False) -> tuple[dict, list[dict]]:
    """launch_recipe, or with in_process (the --quick smoke runs) the recipe's main() in this process."""
    if not in_process:
        return launch_recipe(recipe, args)
    import tempfile
    from pathlib import Path

    from ft_accum.testing import read_metrics, run_in_process

    with tempfile.TemporaryDirectory() as out:
        return run_in_process(recipe, [*args, f"--output_dir={out}", "--report_to=none"]), read_metrics(Path(out))


def machine_info() -> dict:
    """What the figures were measured on: CPU, cores, GPU if any, and the library versions."""
    import platform

    import accelerate
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }


def launch_in_tree(tree, recipe: str, args: list[str], output_dir) -> None:
    """`accelerate launch` of another checkout's recipes/<recipe>.py on its accelerate_configs/cpu.yaml,
    with that checkout's `ft_accum` first on PYTHONPATH (how the benchmarks compare against a commit);
    its stderr's end in the error if it fails."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tree = Path(tree)
    env = os.environ | {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(tree / "accelerate_configs/cpu.yaml"),
        str(tree / "recipes" / f"{recipe}.py"),
        *args,
        "--output_dir",
        str(output_dir),
        "--report_to",
        "none",
    ]
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree.name} {recipe} failed:\n{proc.stderr[-3000:]}")
