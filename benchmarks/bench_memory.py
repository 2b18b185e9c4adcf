"""python benchmarks/bench_memory.py [--repeats 3] [--quick]

Peak memory at an equal effective batch: what accumulation, gradient checkpointing and LoRA each buy.
recipes/causal_lm.py on its offline default model (SmolLM2-135M-Instruct, fp32) and data (BBC News),
packed 128-token blocks, 8 sequences per update as 8 × 1 (the full batch) or 2 × 4 (accumulated),
each with and without --gradient_checkpointing and --use_lora (r 8, all linear layers): 8 settings.

Each run is a fresh `accelerate launch` of 2 updates, so its peak is its own. On CPU the figure is
the process's peak resident set size (`ru_maxrss`): weights, gradients, optimizer state and
activations, but also the Python interpreter, the libraries, the tokenized data and the allocator's
cached pages. On a GPU the recipe reports `torch.cuda.max_memory_allocated` instead. The settings
are interleaved within each repeat; the table gives the median over repeats.
--quick: a tiny GPT-2 from a config, two settings, in this process (the figures mean nothing).
"""

import statistics
import sys
import tempfile
from pathlib import Path

from ft_accum.testing.benchmarking import repeats_main, run_recipe

ROOT = Path(__file__).resolve().parents[1]

EFFECTIVE_BATCH, BLOCK, UPDATES = 8, 128, 2
SETTINGS = [
    {"micro": micro, "gradient_checkpointing": ckpt, "use_lora": lora}
    for lora in (False, True)
    for ckpt in (False, True)
    for micro in (8, 2)
]


def label(setting: dict) -> str:
    parts = [f"{setting['micro']} × {EFFECTIVE_BATCH // setting['micro']}"]
    parts += ["grad ckpt"] if setting["gradient_checkpointing"] else []
    parts += ["LoRA r 8"] if setting["use_lora"] else ["full fine-tune"]
    return ", ".join(parts)


def recipe_args(setting: dict, model_dir: Path | None, block: int) -> list[str]:
    return ([f"--model_name_or_path={model_dir}"] if model_dir else []) + [
        "--packing",
        f"--block_size={block}",
        f"--per_device_train_batch_size={setting['micro']}",
        f"--gradient_accumulation_steps={EFFECTIVE_BATCH // setting['micro']}",
        f"--max_train_steps={UPDATES}",
        "--max_train_samples=40",
        "--max_eval_samples=2",
        "--per_device_eval_batch_size=2",
        f"--gradient_checkpointing={setting['gradient_checkpointing']}",
        f"--use_lora={setting['use_lora']}",
        "--lora_r=8",
        "--lora_alpha=16",
        "--seed=42",
    ]


def measure(repeats: int = 3, quick: bool = False) -> dict:
    settings = SETTINGS[:2] if quick else SETTINGS
    runs = {label(s): [] for s in settings}
    with tempfile.TemporaryDirectory() as models:
        model_dir = None
        if quick:
            from ft_accum.testing import load_script

            _bench_loop_overhead = load_script(ROOT / "benchmarks" / "bench_loop_overhead.py")
            build_model_dir = _bench_loop_overhead.build_model_dir

            model_dir = build_model_dir("lm", True, Path(models) / "lm")
        for repeat in range(repeats):
            for setting in settings:
                args = recipe_args(setting, model_dir, 64 if quick else BLOCK)  # the quick model has 64 positions
                result = run_recipe("causal_lm", args, in_process=quick)[0]
                runs[label(setting)].append(result["peak_memory_gb"])
                print(
                    f"repeat {repeat + 1}/{repeats} {label(setting)}: {result['peak_memory_gb']:.2f} GiB",
                    file=sys.stderr,
                )
    return {
        "setup": {
            "model": "tiny GPT-2 (quick)" if quick else "SmolLM2-135M-Instruct",
            "effective_batch": EFFECTIVE_BATCH,
            "block_size": 64 if quick else BLOCK,
            "updates": UPDATES,
            "repeats": repeats,
            "precision": "fp32",
            "device": "cpu",
            "measure": "peak RSS (ru_maxrss), fresh process",
            "quick": quick,
        },
        "settings": [{**s, "label": label(s)} for s in settings],
        "runs": runs,
        "median_gb": {name: statistics.median(values) for name, values in runs.items()},
    }


if __name__ == "__main__":
    repeats_main(measure, __doc__, ROOT / "benchmarks" / "results" / "memory.json")
