"""Checkpoints that are complete or absent, never half-written.

Layout: `output_dir/checkpoints/step_000120/` holds what `accelerator.save_state` writes (model,
optimizer, scheduler, sampler and RNG states of every process) plus `training_state.json` (the
update counter, the running totals, and a manifest of every file's size and sha256), which is
written last and marks the checkpoint complete. A checkpoint whose files do not match its manifest
(truncated by a full disk, corrupted later) is skipped by `latest` with a warning, never loaded.
Checkpoints are only taken at sync steps, so a resumed run never starts inside a window.
The state also records the run's signature (the model's parameter names and shapes, the batch
arithmetic, the seed): a resume that would silently change the run is refused before anything
is loaded. Every file goes through safetensors or `torch.load(weights_only=True)` (Accelerate's
`load`), so loading a checkpoint never runs code from it.

Each checkpoint is written to `checkpoints/.tmp-step_000120/` and renamed into place once every
process has finished writing. A rename within one filesystem is atomic (POSIX rename(2)), so a
crash leaves either the old set of checkpoints or the new one, plus a `.tmp-*` folder that
`latest_checkpoint` ignores and the next save removes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from ft_accum.core.errors import ConfigError
from ft_accum.core.integrity import sha256_of
from ft_accum.training.collective_timeout import is_collective_failure

STATE_FILE = "training_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    """`step_000120`: zero-padded so that names sort in step order."""
    return f"step_{step:06d}"


def save_checkpoint(
    accelerator,
    output_dir: str | os.PathLike,
    step: int,
    state: dict[str, Any],
    save_total_limit: int | None = None,
    keep: str | None = None,
) -> Path:
    """Save `accelerator.save_state` plus `state` atomically; call it on every process at a sync step.

    With `save_total_limit`, older complete checkpoints beyond the newest K are deleted, only after
    the new one is complete; never the one named `keep` (the best evaluation's). A failed write (a full disk) removes the partial folder and raises a
    ConfigError that names the checkpoint still intact.
    """
    root = Path(output_dir) / "checkpoints"
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}"
    for model in accelerator._models:
        check_finite_parameters(accelerator.unwrap_model(model), f"checkpoint {final.name}")
    if accelerator.is_main_process:
        for stale in root.glob(".tmp-*") if root.is_dir() else ():
            shutil.rmtree(stale, ignore_errors=True)  # left by a run killed while saving
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _write_json_durably(tmp / STATE_FILE, {"step": step, **state, "manifest": _manifest(tmp)})
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        if is_collective_failure(exc):  # a peer lost in the save's barrier: collective_failures names it
            raise
        previous = latest_checkpoint(output_dir)
        then = (
            f"then resume from the intact {previous} with --resume_from_checkpoint latest"
            if previous
            else "then run again (no earlier checkpoint exists)"
        )
        free = f"{shutil.disk_usage(root).free / 2**20:.0f} MiB free there"
        if not is_out_of_space(exc):  # name the cause seen, not the most common one
            raise ConfigError(
                f"could not write checkpoint {final}: {type(exc).__name__} in {_raised_in(exc)}: {_first_line(exc)} "
                f"(not a full disk: {free}); fix that cause, {then}"
            ) from exc
        needed = f", one checkpoint takes {_folder_mib(previous):.0f} MiB" if previous else ""
        raise ConfigError(
            f"could not write checkpoint {final} (the write failed: {_first_line(exc)}; {free}{needed}); "
            f"free disk space or lower --save_total_limit, {then}"
        ) from exc
    if accelerator.is_main_process:
        if final.exists():
            # A re-run reached the same step: swap the old one out first, since rename(2)
            # cannot replace a non-empty directory.
            stale = root / f".tmp-old-{checkpoint_name(step)}"
            os.replace(final, stale)
            shutil.rmtree(stale)
        os.replace(tmp, final)
        _fsync_dir(root)
        if save_total_limit:
            for old in list_checkpoints(output_dir)[:-save_total_limit]:
                if old.name != keep:
                    shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


OUT_OF_SPACE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# How torch.save and safetensors word a failed write when they do not raise an OSError.
OUT_OF_SPACE_WORDS = ("no space left", "file too large", "disk quota", "file write failed")


def is_out_of_space(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is a write that ran out of room (disk, quota, file size limit)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in OUT_OF_SPACE_ERRNOS:
            return True
        if any(words in str(exc).lower() for words in OUT_OF_SPACE_WORDS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _raised_in(exc: BaseException) -> str:
    """The module and function that raised `exc`, e.g. 'torch.distributed.checkpoint.state_dict_saver.save'."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "an unknown place"
    frame = frames[-1]
    path = Path(frame.filename)
    parts = path.with_suffix("").parts
    package = next((i for i, part in enumerate(parts) if part in ("site-packages", "ft_accum", "recipes")), None)
    module = ".".join(
        parts[package + 1 :] if package is not None and parts[package] == "site-packages" else parts[-2:]
    )
    return f"{module}.{frame.name}"


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under `output_dir/checkpoints`, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first: marked by training_state.json, every file its manifest's size."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
    ]
    complete = []
    for _, path in sorted(found):
        if problem := checkpoint_problem(path, verify_hashes=False):
            warnings.warn(f"skipping checkpoint {path}: {problem}", stacklevel=2)
        else:
            complete.append(path)
    return complete


def checkpoint_problem(checkpoint: Path, verify_hashes: bool = True) -> str | None:
    """Why `checkpoint` must not be loaded (missing, truncated or altered file), or None if it is sound."""
    try:
        manifest = load_training_state(checkpoint).get("manifest")
    except (OSError, ValueError) as exc:
        return f"unreadable {STATE_FILE}: {exc}"
    if manifest is None:
        return None  # written before manifests existed: nothing to check against
    for name, expected in manifest.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, not {expected['size']}"
        if verify_hashes and sha256_of(path) != expected["sha256"]:
            return f"{name} does not match its sha256"
    return None


def resolve_auto_resume(resume_from_checkpoint: str | None, output_dir: str | os.PathLike) -> str | None:
    """`--resume_from_checkpoint auto`: "latest" when --output_dir holds a complete checkpoint, else None
    (a fresh start); any other value unchanged. What a requeued SLURM job runs: the same command,
    which continues wherever the run got to."""
    if resume_from_checkpoint != "auto":
        return resume_from_checkpoint
    return "latest" if list_checkpoints(output_dir) else None


def resolve_resume_checkpoint(resume_from_checkpoint: str, output_dir: str | os.PathLike) -> Path:
    """Turn `--resume_from_checkpoint PATH|latest` into a complete checkpoint folder, or explain."""
    available = list_checkpoints(output_dir)
    listing = ", ".join(str(p) for p in available) or f"none under {Path(output_dir) / 'checkpoints'}"
    if resume_from_checkpoint == "latest":
        for candidate in reversed(available):
            problem = checkpoint_problem(candidate)
            if problem is None:
                return candidate
            warnings.warn(f"skipping checkpoint {candidate}: {problem}; trying the one before it", stacklevel=2)
        raise ConfigError(
            f"--resume_from_checkpoint latest: no complete checkpoint under "
            f"{Path(output_dir) / 'checkpoints'}; check --output_dir, or start without resuming"
        )
    path = Path(resume_from_checkpoint)
    if path.is_file():
        raise ConfigError(
            f"--resume_from_checkpoint {resume_from_checkpoint} is a file; pass its checkpoint folder "
            f"({path.parent}), one of: {listing}, or 'latest'"
        )
    if not path.is_dir():
        raise ConfigError(
            f"--resume_from_checkpoint {resume_from_checkpoint} does not exist; pass one of: {listing}, or 'latest'"
        )
    if not (path / STATE_FILE).is_file():
        raise ConfigError(
            f"--resume_from_checkpoint {resume_from_checkpoint} is not a complete checkpoint "
            f"(no {STATE_FILE}); pass one of: {listing}, or 'latest'"
        )
    if problem := checkpoint_problem(path):
        raise ConfigError(
            f"--resume_from_checkpoint {resume_from_checkpoint} is damaged ({problem}); pass one of: {listing}, or 'latest'"
        )
    return path


def resume_training_state(
    accelerator, resume_from_checkpoint: str, output_dir: str | os.PathLike, signature: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler, sampler and RNG states; return the saved training state.

    With `signature` (see `run_signature`), a checkpoint from another model or another batch
    arithmetic is refused before anything is loaded.
    """
    checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, output_dir)
    state = load_training_state(checkpoint)
    if signature is not None:
        for note in check_resume_signature(state.get("signature"), signature, checkpoint):
            accelerator.print(f"note: {note}")
    try:
        accelerator.load_state(str(checkpoint))
    except pickle.UnpicklingError as exc:
        raise ConfigError(
            f"checkpoint {checkpoint} holds a file that is not plain tensors, and torch.load(weights_only=True) "
            f"refused it ({_first_line(exc)}); only resume from checkpoints this tool wrote"
        ) from exc
    accelerator.print(f"Resumed from {checkpoint} at update {state['step']}")
    return state


def run_signature(
    model,
    *,
    effective_batch_size: int,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    num_processes: int,
    seed: int,
    optim: str,
    accumulation_schedule: str | None = None,
    mixed_precision: str | None = None,
) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it.

    `model` is a sha256 over the (unwrapped) model's parameter names and shapes: another
    architecture, size, number of labels or LoRA layout gives another digest.
    """
    shapes = ";".join(f"{name}:{tuple(p.shape)}" for name, p in model.state_dict().items())
    return {
        "model": f"{type(model).__name__}:{hashlib.sha256(shapes.encode()).hexdigest()[:16]}",
        "effective_batch_size": effective_batch_size,
        "per_device_train_batch_size": per_device_train_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "num_processes": num_processes,
        "seed": seed,
        "optim": optim,
        "accumulation_schedule": accumulation_schedule,
        "mixed_precision": mixed_precision,
    }


def check_resume_signature(saved: dict[str, Any] | None, current: dict[str, Any], checkpoint: Path) -> list[str]:
    """Refuse a resume that would change the run; return notes on harmless changes.

    Refused: another model (its weights would not fit), another effective batch (the LR schedule
    and the data position are counted in updates of that batch), another process count or seed
    (the per-process RNG states and the sample order would no longer line up), another optimizer
    (its saved state has other fields). A new split of the
    same effective batch (micro × accumulation) gives the same updates up to summation order.
    """
    if saved is None:
        return []  # written before signatures existed
    if saved["model"] != current["model"]:
        raise ConfigError(
            f"checkpoint {checkpoint} was saved from a different model ({saved['model']}, this run builds {current['model']}); "
            "resume with the same --model_name_or_path and settings, or use a new --output_dir"
        )
    reasons = {
        "effective_batch_size": "the update count, LR schedule and data position are counted in updates of that batch",
        "num_processes": "the per-process RNG and sampler states would not line up",
        "seed": "the sample order would change mid-run",
        "optim": "its saved optimizer state belongs to the other optimizer",
        "accumulation_schedule": "the effective batch of the updates done and to come would differ",
    }
    for key, reason in reasons.items():
        if saved.get(key) != current.get(key):
            raise ConfigError(
                f"checkpoint {checkpoint} was trained with {key} {saved.get(key)}, this run has {current.get(key)}: {reason}; "
                f"resume with --{key} {saved.get(key)}, or start a new --output_dir"
            )
    # Absent from checkpoints written before issue 26; set by the Accelerate config, not a flag.
    if "mixed_precision" in saved and saved["mixed_precision"] != current.get("mixed_precision"):
        raise ConfigError(
            f"checkpoint {checkpoint} was trained with mixed precision {saved['mixed_precision']}, this launch runs "
            f"{current.get('mixed_precision')}: resume with the launch command in resume_command.txt beside the checkpoints "
            "(its --config_file sets the precision)"
        )
    if (saved["per_device_train_batch_size"], saved["gradient_accumulation_steps"]) != (
        current["per_device_train_batch_size"],
        current["gradient_accumulation_steps"],
    ):
        was = f"{saved['per_device_train_batch_size']} × {saved['gradient_accumulation_steps']}"
        return [
            f"the checkpoint split the same effective batch as {was}; the updates stay the same up to "
            "float summation order, so the run is equivalent but not bit-identical"
        ]
    return []


def check_finite_parameters(model, what: str) -> None:
    """Refuse to save NaN or infinite weights: a checkpoint must be worth resuming from. Only trainable
    parameters are read: frozen ones are the loaded model's, which training does not change, and in
    a LoRA run they are nearly all of its bytes (each read is a pass over them at every checkpoint)."""
    trained = ((name, p) for name, p in model.named_parameters() if p.requires_grad)
    bad = next((name for name, p in trained if not torch.isfinite(p).all()), None)
    if bad is not None:
        raise ConfigError(
            f"parameter {bad} is not finite, so {what} was not saved; lower --learning_rate and resume from the last checkpoint"
        )


def load_training_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The `training_state.json` saved beside the accelerator state."""
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def _folder_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_of(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != STATE_FILE
    }


def _write_json_durably(path: Path, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
