"""python benchmarks/bench_grpo_log_probs.py [--quick] [--output benchmarks/results/grpo_log_probs.json]

The time of GRPO's chunked log-probs (`output_loss.token_log_probs`, the recipe's since 2026-12-06)
against the unchunked log-softmax it replaced: `generation_round.completion_log_probs` forward and
backward on the bundled SmolLM2-135M-Instruct with LoRA r 16 on every linear layer, 8 completions
of 96 tokens after 64 prompt tokens, fp32 on this machine's CPU; the two alternate, 5 pairs after
one warm-up step, and the figure is the median of the pairs' ratios (chunked / unchunked).
The memory side is tested, not benchmarked: tests/test_output_loss.py measures the step's peak on
real tensors, and `ft-accum plan --task grpo` predicts it on a GPU.
--quick: the tests' 2-layer Llama, 2 pairs (tests the script; its figures say nothing).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ft_accum.testing import make_tiny_chat_lm  # noqa: E402
from ft_accum.testing.benchmarking import machine_info  # noqa: E402
from ft_accum.training import generation_round  # noqa: E402


def unchunked_token_log_probs(logits, token_ids):
    """What completion_log_probs computed before: every position's fp32 log-softmax at once."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
    return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1), entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 pairs: tests the script")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "grpo_log_probs.json")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from ft_accum.data.offline_assets import bundled_smollm2_dir
    from ft_accum.models.lora import LoraSettings, apply_lora

    with tempfile.TemporaryDirectory() as tmp:
        source = make_tiny_chat_lm(Path(tmp) / "tiny") if args.quick else bundled_smollm2_dir()
        model = AutoModelForCausalLM.from_pretrained(source)
    torch.manual_seed(0)
    model = apply_lora(model, LoraSettings(r=16, alpha=32, dropout=0.0, target_modules="all-linear"), False)
    rows, prompt, completion = 8, 64, 96
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt + completion))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_ids": ids[:, prompt:],
             "position_ids": torch.arange(prompt + completion).expand(rows, -1)}  # fmt: skip

    def step() -> float:
        started = time.perf_counter()
        log_probs, _ = generation_round.completion_log_probs(model, batch)
        log_probs.sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    step()  # warm-up
    seconds = {"chunked": [], "unchunked": []}
    for _ in range(2 if args.quick else 5):
        seconds["chunked"].append(step())
        with mock.patch.object(generation_round, "token_log_probs", unchunked_token_log_probs):
            seconds["unchunked"].append(step())
    ratio = statistics.median(a / b for a, b in zip(seconds["chunked"], seconds["unchunked"]))
    summary = {"quick": args.quick, "machine": machine_info(), "seconds": seconds, "chunked_over_unchunked": ratio}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(
        f"chunked {medians['chunked']:.3f} s, unchunked {medians['unchunked']:.3f} s a step; pairs' ratio {ratio:.3f}"
    )


if __name__ == "__main__":
    main()
