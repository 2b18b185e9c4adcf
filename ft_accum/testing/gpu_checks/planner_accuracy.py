"""GPU check 2: the planner's predicted peak against the causal-LM recipe's `torch.cuda.max_memory_allocated`."""

from collections.abc import Iterator
from pathlib import Path

from ft_accum.testing.gpu_checks.common import lm_args, planner_row, random_model_dir, recipe_run, shrink_for_dry_run


def check_planner(models: Path, dry_run: bool) -> Iterator[dict]:
    from ft_accum.planner.configs import load_model_config
    from ft_accum.planner.tracing import trace_micro_batches

    config = load_model_config("gpt2-124m")
    block, micros = 1024, [1, 4, 8]
    if dry_run:
        shrink_for_dry_run(config)
        block, micros = 64, [2]
    model_dir = random_model_dir(config, "causal_lm", models / "gpt2-planner")
    for checkpointing in (False, True):
        settings = dict(task="causal_lm", seq_len=block, precision="bf16-mixed", gradient_checkpointing=checkpointing)
        traced = trace_micro_batches(config, micros, **settings)
        for micro in micros:
            predicted = max(e.peak for e in traced[micro]) / 2**30
            _, measured, _ = recipe_run("causal_lm", lm_args(model_dir, block, micro, 1, 3, checkpointing), "bf16")
            check = f"planner / recipe peak, GPT-2 124M, {micro} × {block}, checkpointing {'on' if checkpointing else 'off'}"
            yield planner_row(check, predicted, measured, dry_run)
