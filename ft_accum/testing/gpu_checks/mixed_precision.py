"""GPU check 1: the text-classification recipe at (8 × 1) against (2 × 4) under bf16, fp16 and fp32."""

import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ft_accum.testing.gpu_checks.common import CONFIGS, TOLERANCE, launch_with_config


def check_mixed_precision(
    model_dir: Path, precisions, updates: int, seq_len: int, in_process: bool = False
) -> Iterator[dict]:
    from ft_accum.testing import final_weights, relative_error

    for precision in precisions:
        with tempfile.TemporaryDirectory() as out:
            common = [
                f"--model_name_or_path={model_dir}",
                f"--max_seq_length={seq_len}",
                f"--max_train_steps={updates}",
                "--max_eval_samples=16",
                "--learning_rate=1e-4",
                "--lr_scaling=none",
                "--weight_decay=0",
                "--num_warmup_steps=0",
                "--seed=42",
                f"--max_train_samples={8 * updates}",
            ]
            config = CONFIGS[precision] if torch.cuda.is_available() or precision == "no" else "cpu.yaml"
            launch_with_config(
                config,
                [*common, "--per_device_train_batch_size=8", "--gradient_accumulation_steps=1"],
                Path(out) / "full",
                in_process,
            )
            launch_with_config(
                config,
                [*common, "--per_device_train_batch_size=2", "--gradient_accumulation_steps=4"],
                Path(out) / "accumulated",
                in_process,
            )
            error = relative_error(final_weights(Path(out) / "accumulated"), final_weights(Path(out) / "full"))
        yield {
            "check": f"(8 × 1) = (2 × 4), {precision if precision != 'no' else 'fp32'}",
            "measured": f"{error:.1e}",
            "bound": f"≤ {TOLERANCE[precision]:.0e}",
            "pass": error <= TOLERANCE[precision],
        }
