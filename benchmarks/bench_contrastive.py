"""Contrastive accumulation against sentence-transformers' cached loss (issue 55).

    pip install sentence-transformers==6.3.0   # a test/benchmark dependency only, never a runtime one
    python benchmarks/bench_contrastive.py [--output benchmarks/results/contrastive.json]

The bundled all-MiniLM-L6-v2 (loaded once, as a `SentenceTransformer`: Transformer → mean pooling →
normalise), the first 256 BBC News headline → opening-sentence training pairs, fp32 on the CPU, dropout
off (eval mode: one forward of the whole batch is then the reference), scale 20. One update of 256 pairs,
side by side in one run, at micro-batches of 16 and 32:

1. gradient error ‖g − g_full‖ / ‖g_full‖ against sentence-transformers' `MultipleNegativesRankingLoss`
   on the whole batch in one forward (the uncached full batch): naive accumulation (each micro-batch's
   own in-batch loss, ÷ the micro-batches), sentence-transformers' `CachedMultipleNegativesRankingLoss`
   (`mini_batch_size` = the micro-batch), and ours (training/embedding_cache.py with
   core/contrastive_loss.py, as recipes/contrastive_embedding.py runs them);
2. seconds per update, tokenisation included, as each would run in training: the full batch and
   sentence-transformers' cached loss tokenise the whole batch (their collator does, so every
   mini-batch is padded to the batch's longest text), naive accumulation and ours each micro-batch
   (our loader pads each micro-batch to its own longest). Best of `--repeats`, the methods taking turns;
3. peak memory of one update at micro 16 against the full batch: the growth of the peak RSS over the
   loaded model in a fresh process per method, and the planner's prediction (`ft-accum plan --task
   contrastive`) for the same model and batch;
4. held-out retrieval after one epoch of the recipe at effective batch 16, at 16 × 16 with naive
   accumulation (a copy of the recipe with the ordinary loss line), and exact at 256 (16 × 16):
   what the batch size buys (`--skip_training` leaves it out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCALE = 20.0
METHODS = ("full batch", "naive", "sentence-transformers cached", "ours")


def load(num_pairs: int):
    from sentence_transformers import SentenceTransformer

    from ft_accum.data.offline_assets import bundled_minilm_dir, load_bbc_retrieval_pairs

    torch.manual_seed(0)
    model = SentenceTransformer(str(bundled_minilm_dir()), device="cpu").eval()  # eval: dropout off
    pairs = load_bbc_retrieval_pairs()["train"].select(range(num_pairs))
    return model, pairs["anchor"], pairs["positive"]


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def one_update(model, anchors: list[str], positives: list[str], method: str, micro: int) -> torch.Tensor:
    """The gradient of the mean loss over all pairs, as `method` computes it (tokenisation included)."""
    from sentence_transformers.sentence_transformer import losses

    from ft_accum.core.contrastive_loss import contrastive_losses
    from ft_accum.models.sentence_embedding import sentence_embeddings
    from ft_accum.training.embedding_cache import EmbeddingCache

    model.zero_grad(set_to_none=True)
    n = len(anchors)
    if method in ("full batch", "sentence-transformers cached"):
        features = [model.tokenize(anchors), model.tokenize(positives)]
        loss = (
            losses.MultipleNegativesRankingLoss(model, scale=SCALE)
            if method == "full batch"
            else losses.CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=micro)
        )
        loss(features, None).backward()
        return flat_grad(model)
    micro_batches = [
        {f"{c}_{k}": v for c, texts in (("anchor", anchors), ("positive", positives))
         for k, v in model.tokenize(texts[start : start + micro]).items() if k != "token_type_ids"}
        for start in range(0, n, micro)
    ]  # fmt: skip
    encoder = model[0].auto_model

    def embed(batch):
        columns = ("anchor", "positive")
        return tuple(
            sentence_embeddings(encoder, batch[f"{c}_input_ids"], batch[f"{c}_attention_mask"]) for c in columns
        )

    if method == "naive":
        for batch in micro_batches:
            (contrastive_losses(*embed(batch), scale=SCALE).mean() / len(micro_batches)).backward()
        return flat_grad(model)
    cache = EmbeddingCache(None, embed, lambda *columns: contrastive_losses(*columns, scale=SCALE))
    cache.first_pass(micro_batches)
    for batch in micro_batches:
        _, surrogate = cache.replay(batch)
        (surrogate / n).backward()
    return flat_grad(model)


def gradients_and_times(model, anchors, positives, micros: list[int], repeats: int) -> dict:
    """Each method's gradient error and best time; the methods take turns in each repeat, so a drift in the
    machine's speed falls on all of them."""
    seconds = {"full batch": []}
    gradients = {}
    for _ in range(repeats):
        for micro in micros:
            for method in ("full batch", *METHODS[1:]) if micro == micros[0] else METHODS[1:]:
                key = method if method == "full batch" else f"{method} @ {micro}"
                start = time.perf_counter()
                gradients[key] = one_update(model, anchors, positives, method, micro)
                seconds.setdefault(key, []).append(time.perf_counter() - start)
    reference = gradients.pop("full batch")
    results = {"full batch": {"seconds_per_update": min(seconds["full batch"])}}
    for key, gradient in gradients.items():
        error = float((gradient - reference).norm() / reference.norm())
        results[key] = {"relative_gradient_error": error, "seconds_per_update": min(seconds[key])}
        print(f"{key}: error {error:.1e}, {min(seconds[key]):.2f} s per update", flush=True)
    return results


def status_kib(field: str) -> int:
    return int(
        next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field)).split()[1]
    )


def peak_rss_growth(method: str, micro: int, num_pairs: int) -> float:
    """MiB: the peak RSS during one update minus the RSS before it, in this fresh process (Linux: writing 5 to
    /proc/self/clear_refs resets the peak, VmHWM, to the current RSS, so loading's own peak does not count)."""
    model, anchors, positives = load(num_pairs)
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kib("VmRSS:")
    one_update(model, anchors, positives, method, micro)
    return (status_kib("VmHWM:") - before) / 1024


def memory(num_pairs: int, micro: int, max_seq_length: int) -> dict:
    from ft_accum.data.offline_assets import bundled_minilm_dir
    from ft_accum.planner.memory_planner import plan
    from ft_accum.planner.tracing import GIB

    measured = {}
    for method, size in (("full batch", num_pairs), ("ours", micro)):
        probe = [sys.executable, __file__, "--memory_probe", method, "--micro", str(size), "--pairs", str(num_pairs)]
        measured[f"{method} @ {size}"] = json.loads(subprocess.run(probe, capture_output=True, text=True, check=True).stdout.splitlines()[-1])  # fmt: skip
    planned = plan(str(bundled_minilm_dir()), task="contrastive", seq_len=max_seq_length,
                   effective_batch_size=num_pairs, gpu_memory_gib=12, precision="fp32")  # fmt: skip
    predicted = {
        r["per_device_train_batch_size"]: r["peak_gib"] * GIB / 2**20
        for r in planned["candidates"]
        if not r["gradient_checkpointing"] and r["per_device_train_batch_size"] in (micro, num_pairs)
    }
    return {"peak_rss_growth_mib": measured, "planner_peak_mib": predicted, "planner_seq_len": max_seq_length}


def retrieval_after_one_epoch(output_dir: Path) -> dict:
    """One epoch of the recipe's defaults at effective 16, naive 16 × 16, and exact 16 × 16 = 256."""
    from ft_accum.testing import reset_accelerate_state
    from ft_accum.training.recipe_modules import load_recipe_module

    source = (ROOT / "recipes" / "contrastive_embedding.py").read_text()
    naive = output_dir / "naive_contrastive_embedding.py"
    naive.write_text(source.replace(
        "loss_sum, surrogate = cache.replay(batch)",
        "loss_sum = surrogate = contrastive_loss.contrastive_losses(*embed(model, batch), scale=task.scale).sum()"))  # fmt: skip
    runs = {
        "effective 16": (ROOT / "recipes" / "contrastive_embedding.py", 16),
        "naive 16 x 16": (naive, 256),
        "exact 256 (16 x 16)": (ROOT / "recipes" / "contrastive_embedding.py", 256),
    }
    results = {}
    for name, (recipe, effective) in runs.items():
        args = ["--config", str(ROOT / "recipes" / "configs" / "contrastive_embedding.yaml"), "--num_train_epochs", "1",
                "--per_device_train_batch_size", "16", "--effective_batch_size", str(effective),
                "--output_dir", str(output_dir / name.split()[0] / str(effective)), "--checkpointing_steps", "1000"]  # fmt: skip
        try:
            run = load_recipe_module(recipe).main(args)
        finally:
            reset_accelerate_state()
        results[name] = {k: run[k] for k in run if k.startswith(("eval_", "initial_eval_"))}
        results[name]["train_runtime"] = run["train_runtime"]
        print(name, results[name], flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "contrastive.json"))
    parser.add_argument("--pairs", type=int, default=256, help="pairs per update (the effective batch)")
    parser.add_argument("--micros", type=int, nargs="+", default=[16, 32], help="micro-batch sizes")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per method; the best counts")
    parser.add_argument("--skip_training", action="store_true", help="leave out the one-epoch retrieval runs")
    parser.add_argument("--memory_probe", help=argparse.SUPPRESS)
    parser.add_argument("--micro", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_probe:  # a fresh process: one method's peak RSS
        print(json.dumps(peak_rss_growth(args.memory_probe, args.micro, args.pairs)))
        return
    model, anchors, positives = load(args.pairs)
    lengths = [len(ids) for ids in model.tokenizer(list(anchors) + list(positives))["input_ids"]]
    results = {
        "command": "python benchmarks/bench_contrastive.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{torch.get_num_threads()} CPU threads, fp32",
        "pairs": args.pairs,
        "update": gradients_and_times(model, anchors, positives, args.micros, args.repeats),
        "memory": memory(args.pairs, min(args.micros), max(lengths)),
    }
    if not args.skip_training:
        with tempfile.TemporaryDirectory() as tmp:
            results["retrieval_after_one_epoch"] = retrieval_after_one_epoch(Path(tmp))
    elif Path(args.output).is_file():  # keep the last run's training figures
        previous = json.loads(Path(args.output).read_text())
        if "retrieval_after_one_epoch" in previous:
            results["retrieval_after_one_epoch"] = previous["retrieval_after_one_epoch"]
            results["retrieval_after_one_epoch_command"] = previous["command"]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
