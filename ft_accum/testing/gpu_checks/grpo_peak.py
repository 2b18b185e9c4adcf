"""GPU check 7: the GRPO recipe's peak outside generation against the planner's, and generation's speed."""

import statistics
from collections.abc import Iterator
from pathlib import Path

from ft_accum.testing.gpu_checks.common import (
    cuda_peak_gib,
    planner_row,
    random_model_dir,
    recipe_run,
    reset_cuda_peak,
)


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
