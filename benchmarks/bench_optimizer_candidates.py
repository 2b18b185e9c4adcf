"""python benchmarks/bench_optimizer_candidates.py [--quick]

The candidates for `--optim adamw_8bit` (issue 17), side by side on this machine: PyTorch's fused
AdamW (the reference), bitsandbytes' AdamW8bit, and torchao's AdamW8bit and AdamW4bit when torchao
is installed (the [lowmem] extra; --quick leaves them out). One 2048 × 2048 fp32 weight, the same
seeded gradients, 8 steps at LR 1e-3:

- the first step's seconds (torchao compiles its step with torch.compile) and the median of the rest;
- the optimizer state's bytes per parameter;
- how far each ends from fused fp32 AdamW, relative to how far AdamW moved the weight.

torchao's CPUOffloadOptimizer is not timed: it asserts a CUDA or XPU device. docs/low_memory.md
gives the reasons it was not chosen either way. Results: benchmarks/results/optimizer_candidates.json.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ft_accum.testing.benchmarking import machine_info, optimizer_state_bytes

ROOT = Path(__file__).resolve().parents[1]


def candidates(with_torchao: bool = True) -> dict:
    found = {"torch fused AdamW (fp32 states)": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)}
    try:
        import bitsandbytes

        found["bitsandbytes AdamW8bit"] = lambda p: bitsandbytes.optim.AdamW8bit(p, lr=1e-3)
    except ImportError:
        pass
    if not with_torchao:
        return found
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        found["torchao AdamW8bit"] = lambda p: AdamW8bit(p, lr=1e-3)
        found["torchao AdamW4bit"] = lambda p: AdamW4bit(p, lr=1e-3)
    except ImportError:
        pass
    return found


def measure(size: int, steps: int, with_torchao: bool = True) -> dict:
    torch.manual_seed(0)
    start = torch.randn(size, size) * 0.02
    results, finals = {}, {}
    for name, make in candidates(with_torchao).items():
        weight = torch.nn.Parameter(start.clone())
        optimizer = make([weight])
        generator = torch.Generator().manual_seed(1)
        seconds = []
        for _ in range(steps):
            weight.grad = torch.randn(weight.shape, generator=generator) * 1e-3
            began = time.perf_counter()
            optimizer.step()
            seconds.append(time.perf_counter() - began)
        finals[name] = weight.detach().clone()
        results[name] = {
            "first_step_seconds": seconds[0],
            "step_seconds": statistics.median(seconds[1:]),
            "state_bytes_per_parameter": optimizer_state_bytes(optimizer) / weight.numel(),
        }
    reference = finals["torch fused AdamW (fp32 states)"]
    moved = float((reference - start).norm())
    for name, final in finals.items():
        results[name]["distance_to_fp32_adamw_over_its_move"] = float((final - reference).norm()) / moved
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a 256 × 256 weight, 3 steps, without torchao's candidates (each step compiles on first use: tens "
        "of seconds on an empty inductor cache): a smoke test",
    )
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "optimizer_candidates.json")
    args = parser.parse_args()
    size, steps = (256, 3) if args.quick else (2048, 8)
    results = measure(size, steps, with_torchao=not args.quick)
    for name, r in results.items():
        print(f"{name:<34} first step {r['first_step_seconds']:6.2f} s, then {r['step_seconds'] * 1e3:7.1f} ms; "
              f"{r['state_bytes_per_parameter']:.2f} B/param; off fp32 AdamW by "
              f"{r['distance_to_fp32_adamw_over_its_move']:.3f} of its move")  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"size": size, "steps": steps, "machine": machine_info(), "results": results}, indent=2)
    )


if __name__ == "__main__":
    main()
