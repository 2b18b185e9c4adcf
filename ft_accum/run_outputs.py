"""What every recipe writes to --output_dir, and the checks every recipe makes at start-up.

- `metrics.jsonl`: one JSON object per optimizer update, appended as the run goes.
- `final/`: `save_pretrained` output, written to a temporary folder and renamed (complete or absent).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ft_accum.errors import ConfigError


def resolve_report_to(report_to: str) -> str | None:
    """`auto` → tensorboard when it is installed; `none` → None (no tracker)."""
    if report_to == "auto":
        report_to = "tensorboard" if importlib.util.find_spec("tensorboard") else "none"
    return None if report_to == "none" else report_to


def check_mixed_precision(accelerator) -> None:
    """fp16 without CUDA is an error: Accelerate 1.15 accepts it and silently trains in fp32."""
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise ConfigError(
            "fp16 needs a CUDA GPU and this machine has none; launch with --mixed_precision no (or bf16), "
            "e.g. --config_file accelerate_configs/cpu.yaml"
        )


def append_metrics(output_dir: Path, record: dict[str, Any]) -> None:
    with open(Path(output_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(output_dir: Path, last_step: int) -> None:
    """Keep the lines up to `last_step`: on resume, the updates after the checkpoint run again."""
    path = Path(output_dir) / "metrics.jsonl"
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
        path.write_text("".join(line + "\n" for line in kept))


def save_final(accelerator, model, tokenizer, output_dir: Path, name: str = "final") -> Path:
    """`save_pretrained` (safetensors) of the unwrapped model and the tokenizer into output_dir/name.

    A peft model saves its adapter only. Call on every process: the state dict is gathered
    from all of them (FSDP, DeepSpeed) before the main process writes.
    """
    accelerator.wait_for_everyone()
    tmp, final = Path(output_dir) / f".tmp-{name}", Path(output_dir) / name
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final
