"""python benchmarks/profile_update.py [--quick]

Where an update's time goes: `torch.profiler` over optimizer updates of the plain PyTorch loop and
of recipes/causal_lm.py's loop body, in this process on the CPU (issue 16: host time shows a lot
even without a GPU). The recipe's body is its own code: `training_step` loaded from the recipe, its
`OutputLoss`, its `count_items` and `training/windows.py`'s `Window` (counted before the window
runs) on a real Accelerator; only the progress
bar, metrics.jsonl and checkpoints are left out. Three loops, on the model and data of
bench_loop_overhead.py's "lm" workload (a 4-layer, 256-wide GPT-2 with SmolLM2's 49k vocabulary,
packed 64-token blocks, 8 × 4 per update, fp32, fused AdamW, clipping at 1.0):

- plain:          `(model(**batch).loss / 4).backward()`, step every 4;
- recipe, logits: the recipe with --no_chunked_loss (its loss path before issue 16);
- recipe:         the recipe as it is.

Per loop: milliseconds per update (median of the profiled updates, 1 warm-up left out), host
synchronisations per update (`aten::_local_scalar_dense`: .item(), .tolist(), float(tensor)), and the
operators with the most self CPU time. Results: benchmarks/results/profile_update.json.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ft_accum.testing import load_script, reset_accelerate_state

ROOT = Path(__file__).resolve().parents[1]
ACCUMULATION = 4


def batches(model_dir: Path, updates: int):
    bench = load_script(ROOT / "benchmarks" / "bench_loop_overhead.py")
    model, collate, rows = bench.load_inputs("lm", model_dir, updates * bench.MICRO * ACCUMULATION)
    loader = torch.utils.data.DataLoader(rows, batch_size=bench.MICRO, collate_fn=collate)
    return model, loader


def plain_loop(model, loader):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for i, batch in enumerate(loader):
        (model(**batch).loss / ACCUMULATION).backward()
        if (i + 1) % ACCUMULATION == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            yield


def recipe_loop(model, loader, chunked: bool):
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    from ft_accum.core.batch_arithmetic import BatchPlan
    from ft_accum.models.output_loss import OutputLoss
    from ft_accum.training.windows import Window

    recipe = load_script(ROOT / "recipes" / "causal_lm.py", "profiled_causal_lm")
    plugin = GradientAccumulationPlugin(num_steps=ACCUMULATION, sync_with_dataloader=False)  # as build_accelerator
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    plan = BatchPlan(loader.batch_size, ACCUMULATION, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    output_loss = OutputLoss(accelerator.unwrap_model(model), shift=True, accelerator=accelerator, enabled=chunked)
    stream = iter(loader)
    for _ in range(len(loader) // ACCUMULATION):
        # The recipe's packed blocks have no attention mask.
        micro_batches = [{k: v for k, v in next(stream).items() if k != "attention_mask"} for _ in range(ACCUMULATION)]
        window = Window(accelerator, micro_batches, count_items=recipe.count_items, plan=plan)
        for batch in window:
            with accelerator.accumulate(model):
                loss_sum = recipe.training_step(model, batch, output_loss)
                accelerator.backward(loss_sum * window.scale)
                window.add_loss(loss_sum)
                if accelerator.sync_gradients:
                    window.check_finite_loss()
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        yield
    reset_accelerate_state()


def profile_loop(name: str, model_dir: Path, updates: int) -> dict:
    torch.manual_seed(0)
    model, loader = batches(model_dir, updates)
    loop = plain_loop(model, loader) if name == "plain" else recipe_loop(model, loader, chunked=name == "recipe")
    next(loop)  # warm-up update
    seconds = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(updates - 1):
            started = time.perf_counter()
            next(loop)
            seconds.append(time.perf_counter() - started)
    events = prof.key_averages()
    syncs = sum(e.count for e in events if e.key == "aten::_local_scalar_dense")
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "ms_per_update": 1000 * statistics.median(seconds),
        "host_syncs_per_update": syncs / (updates - 1),
        "top_self_cpu_ms_per_update": {e.key: e.self_cpu_time_total / 1000 / (updates - 1) for e in top},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="a 1-layer, 32-wide model, 2 updates (1 measured): a smoke test"
    )
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "profile_update.json")
    args = parser.parse_args()
    bench = load_script(ROOT / "benchmarks" / "bench_loop_overhead.py")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench.build_model_dir("lm", args.quick, Path(tmp) / "lm")
        updates = 2 if args.quick else 7
        results = {name: profile_loop(name, model_dir, updates) for name in ("plain", "recipe, logits", "recipe")}
    for name, row in results.items():
        print(f"{name}: {row['ms_per_update']:.0f} ms/update, {row['host_syncs_per_update']:.1f} host syncs/update")
        for op, ms in row["top_self_cpu_ms_per_update"].items():
            print(f"    {ms:8.1f} ms  {op}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"quick": args.quick, **results}, indent=2))


if __name__ == "__main__":
    main()
