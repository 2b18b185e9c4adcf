"""GPU check 8: the distillation recipe's CUDA peak against the planner's, and its tokens per second."""

from collections.abc import Iterator
from pathlib import Path

from ft_accum.testing.gpu_checks.common import planner_row, random_model_dir, widest_bf16_run


def check_distillation(models: Path, smollm2: Path | None, dry_run: bool) -> Iterator[dict]:
    """recipes/distillation.py (see the module docstring's check 8): the planner's peak against the run's."""
    from transformers import AutoConfig, LlamaForCausalLM

    from ft_accum.planner.tracing import trace_micro_batches
    from ft_accum.testing import make_tiny_chat_lm

    micro, accumulation, max_length = 8, 2, 512
    if dry_run:  # the tests' 2-layer, 32-wide Llama: a smoke test of the run, not figures
        smollm2 = make_tiny_chat_lm(models / "tiny-chat-distillation")
        micro, accumulation, max_length = 2, 2, 256
    else:
        from ft_accum.data.offline_assets import bundled_smollm2_dir

        smollm2 = smollm2 or bundled_smollm2_dir()
    teacher = random_model_dir(
        AutoConfig.from_pretrained(smollm2), "causal_lm", models / "smollm2-135m-teacher", smollm2
    )
    args = [
        f"--teacher_name_or_path={teacher}",
        f"--per_device_train_batch_size={micro}",
        f"--effective_batch_size={micro * accumulation}",
        f"--max_seq_length={max_length}",
        "--max_train_steps=3",
        f"--max_train_samples={3 * micro * accumulation}",
        "--max_eval_samples=2",
        "--max_new_tokens=1",
        "--learning_rate=1e-4",
        "--lr_scaling=none",
    ]
    # the student's passes: the teacher's have no gradients
    widest, measured, rate = widest_bf16_run("distillation", args, LlamaForCausalLM, warmup=2)
    config = AutoConfig.from_pretrained(teacher)
    traced = trace_micro_batches(config, [micro], task="distillation", seq_len=widest.seq_len, precision="bf16-mixed")
    predicted = max(e.peak for e in traced[micro]) / 2**30
    check = (
        f"distillation planner / recipe peak, SmolLM2-135M sizes teaching half its layers, {micro} × "
        f"{widest.seq_len} tokens, bf16"
    )
    yield planner_row(check, predicted, measured, dry_run, f"; {rate:,.0f} tokens/s", tokens_per_second=rate)
