"""The readers and distances the equivalence checks use: metrics.jsonl, weights, checkpoints, folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over all parameters together."""
    assert a.keys() == b.keys()
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    norm = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (diff / norm) ** 0.5


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def read_evaluations(output_dir: Path) -> list[dict]:
    """eval_metrics.jsonl: one record per evaluation, with the update (`step`) it followed."""
    return [json.loads(line) for line in (Path(output_dir) / "eval_metrics.jsonl").read_text().splitlines() if line]


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path: what 'nothing was damaged' compares."""
    from ft_accum.core.integrity import sha256_of

    return {str(p.relative_to(folder)): sha256_of(p) for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def copy_checkpoint(run_dir: Path, step: int, new_output_dir: Path) -> Path:
    """A fresh --output_dir holding only `run_dir`'s checkpoint at `step`: what a crash right after it leaves to resume from."""
    name = f"step_{step:06d}"
    (new_output_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / name, new_output_dir / "checkpoints" / name)
    return new_output_dir
