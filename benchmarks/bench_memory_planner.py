"""Predicted vs measured peak memory of one training step, for 3 model sizes, on this CPU.

    python benchmarks/bench_memory_planner.py > benchmarks/results/memory_planner.json

Predicted: `ft_accum.planner.memory_planner.trace_step` on fake tensors (no weights allocated).
Measured, on real CPU tensors, in a fresh subprocess per size:
- `torch.distributed._tools.mem_tracker.MemTracker`'s peak (every tensor allocation);
- the growth of the process's peak RSS over the step (what the OS saw: allocator overhead,
  freed-but-cached pages and library buffers included, so it reads higher and noisier).
Also the wall time and peak RSS of `ft-accum plan` on the shipped 8B config.
"""

import json
import resource
import subprocess
import sys
import time

SIZES = {"gpt2-small-ish": (256, 4), "gpt2-medium-ish": (512, 8), "gpt2-large-ish": (768, 12)}  # (width, layers)
MICRO, SEQ_LEN = 4, 256

MEASURE = r"""
import json, resource, sys, torch
from transformers import GPT2Config
from torch.distributed._tools.mem_tracker import MemTracker
from ft_accum.planner.task_specs import build_model
width, layers, micro, seq_len = map(int, sys.argv[1:5])
config = GPT2Config(n_embd=width, n_layer=layers, n_head=width // 64, n_positions=1024)
torch.manual_seed(0)
model = build_model(config, "causal_lm")
opt = torch.optim.AdamW(model.parameters(), foreach=True)
for p in model.parameters():
    p.grad = torch.zeros_like(p)
opt.step(); opt.zero_grad(set_to_none=True)
ids = torch.randint(0, config.vocab_size, (micro, seq_len))
rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
static = sum(p.numel() * 4 * 3 for p in model.parameters())
tracker = MemTracker(); tracker.track_external(model, opt)
with tracker:
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"memtracker_peak": tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"],
                  "rss_growth_plus_static": rss_after - rss_before + static}))
"""


def main():
    from transformers import GPT2Config

    from ft_accum.planner.tracing import GIB, trace_step

    started = time.perf_counter()
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "ft_accum.cli.main",
            "plan",
            "--model",
            "llama-3.1-8b",
            "--seq_len",
            "1024",
            "--effective_batch_size",
            "32",
            "--precision",
            "bf16",
            "--lora_r",
            "16",
            "--gpu_memory",
            "24GiB",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - started
    child_rss = (
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    )  # only the plan has run as a child so far
    rows = []
    for name, (width, layers) in SIZES.items():
        config = GPT2Config(n_embd=width, n_layer=layers, n_head=width // 64, n_positions=1024)
        predicted = trace_step(config, task="causal_lm", micro_batch_size=MICRO, seq_len=SEQ_LEN).peak
        measured = json.loads(
            subprocess.run(
                [sys.executable, "-c", MEASURE, str(width), str(layers), str(MICRO), str(SEQ_LEN)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.splitlines()[-1]
        )
        rows.append(
            {
                "model": name,
                "width": width,
                "layers": layers,
                "micro_batch_size": MICRO,
                "seq_len": SEQ_LEN,
                "predicted_gib": predicted / GIB,
                "memtracker_gib": measured["memtracker_peak"] / GIB,
                "predicted_over_memtracker": predicted / measured["memtracker_peak"],
                "rss_growth_plus_static_gib": measured["rss_growth_plus_static"] / GIB,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(
        json.dumps(
            {
                "sizes": rows,
                "plan_8b_lora": {
                    "wall_seconds": seconds,
                    "peak_rss_gib": child_rss,
                    "recommended": json.loads(plan.stdout)["recommended"],
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
