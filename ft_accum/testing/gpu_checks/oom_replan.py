"""GPU check 5: a real CUDA out-of-memory error re-split by --auto_micro_batch, matching a run at the final split."""

import tempfile
from pathlib import Path

import torch


def check_oom_replan(model_dir: Path) -> list[dict]:
    from ft_accum.testing import final_weights, relative_error, run_in_process

    common = [
        f"--model_name_or_path={model_dir}",
        "--max_seq_length=128",
        "--max_train_steps=2",
        "--max_eval_samples=16",
        "--learning_rate=1e-4",
        "--lr_scaling=none",
        "--weight_decay=0",
        "--num_warmup_steps=0",
        "--seed=42",
        "--max_train_samples=512",
        "--report_to=none",
    ]
    with tempfile.TemporaryDirectory() as out:
        small = run_in_process(
            "text_classification",
            [
                *common,
                "--per_device_train_batch_size=8",
                "--gradient_accumulation_steps=1",
                f"--output_dir={out}/small",
            ],
        )
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, 3 * small["peak_memory_gb"] * 2**30 / total))
        auto = run_in_process(
            "text_classification",
            [
                *common,
                "--per_device_train_batch_size=256",
                "--gradient_accumulation_steps=1",
                "--auto_micro_batch",
                f"--output_dir={out}/auto",
            ],
        )
        torch.cuda.set_per_process_memory_fraction(1.0)
        micro = auto["per_device_train_batch_size"]
        run_in_process(
            "text_classification",
            [
                *common,
                f"--per_device_train_batch_size={micro}",
                f"--gradient_accumulation_steps={256 // micro}",
                f"--output_dir={out}/direct",
            ],
        )
        error = relative_error(final_weights(Path(out) / "auto"), final_weights(Path(out) / "direct"))
    return [
        {
            "check": f"real OOM at 256 × 1 → {micro} × {256 // micro}, same as a run started there",
            "measured": f"{error:.1e}",
            "bound": "≤ 1e-05, micro < 256",
            "pass": micro < 256 and error <= 1e-5,
        }
    ]
