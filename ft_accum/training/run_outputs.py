"""What every recipe writes to --output_dir, and the checks every recipe makes at start-up.

- `metrics.jsonl`: one JSON object per optimizer update, appended as the run goes.
- `eval_metrics.jsonl`: one JSON object per evaluation (epoch, step, the eval metrics).
- `final/`: `save_pretrained` output, written to a temporary folder and renamed (complete or absent).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ft_accum.core.errors import ConfigError
from ft_accum.training.checkpointing import check_finite_parameters

EVAL_METRICS_FILE = "eval_metrics.jsonl"


# The trackers tested here (tests/test_trackers.py): the package each needs, and the extra that installs it.
TRACKER_PACKAGES = {"tensorboard": "demo", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def resolve_report_to(report_to: str) -> str | None:
    """`auto` → tensorboard when it is installed; `none` → None (no tracker). A tracker whose package is
    missing is one line naming the extra that installs it."""
    if report_to == "auto":
        report_to = "tensorboard" if importlib.util.find_spec("tensorboard") else "none"
    extra = TRACKER_PACKAGES.get(report_to)
    if extra and importlib.util.find_spec(report_to) is None:
        raise ConfigError(
            f"--report_to {report_to} needs the {report_to} package: pip install 'ft-accum[{extra}]' (or --report_to none)"
        )
    return None if report_to == "none" else report_to


def local_tracker_settings(report_to: str | None, output_dir: str | os.PathLike, environ=os.environ) -> dict:
    """Accelerate's `init_kwargs` that keep a tracker on this machine unless its own environment says
    otherwise: W&B in offline mode (WANDB_MODE) with its files in --output_dir, and MLflow's SQLite store
    in --output_dir (MLFLOW_TRACKING_URI, set here for this process). TensorBoard writes there already;
    Trackio keeps its local SQLite under TRACKIO_DIR (default ~/.cache/huggingface/trackio)."""
    out = Path(output_dir).resolve()
    if report_to == "wandb":
        return {"wandb": {"mode": environ.get("WANDB_MODE", "offline"), "dir": environ.get("WANDB_DIR", str(out))}}
    if report_to == "mlflow":
        import mlflow

        mlflow.set_tracking_uri(environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{out / 'mlflow.db'}"))
    return {}


def batch_split(plan) -> dict[str, int]:
    """A BatchPlan's split under the Trainer's names, as all_results.json and the trackers record it."""
    return {
        "per_device_train_batch_size": plan.micro,
        "gradient_accumulation_steps": plan.accumulation,
        "num_processes": plan.processes,
    }


def tracker_config(settings: dict[str, Any], plan, scaled_learning_rate: float) -> dict[str, Any]:
    """What a tracker records of the run's settings: every scalar flag, and the batch split the run made
    (effective batch, micro-batch, accumulation, processes) with the LR scaled to it, under
    all_results.json's names."""
    scalars = {k: v for k, v in settings.items() if isinstance(v, (int, float, str, bool))}
    return scalars | {
        "effective_batch_size": plan.effective,
        **batch_split(plan),
        "scaled_learning_rate": scaled_learning_rate,
    }


def requested_engine(environ=os.environ) -> str | None:
    """The engine the Accelerate config names, as `accelerate launch` tells its processes: FSDP,
    DEEPSPEED, or None (DDP or one process: the distributed type follows the process count)."""
    for engine in ("FSDP", "DEEPSPEED"):
        if environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true":
            return engine
    return None


def describe_engine(distributed_type: str, num_processes: int) -> str:
    """The banner's engine line, e.g. 'DDP over gloo (MULTI_CPU), 2 processes'."""
    names = {"NO": "one process", "MULTI_CPU": "DDP over gloo (MULTI_CPU)", "MULTI_GPU": "DDP over NCCL (MULTI_GPU)",
             "FSDP": "FSDP (sharded parameters, gradients and optimizer state)", "DEEPSPEED": "DeepSpeed"}  # fmt: skip
    name = names.get(distributed_type, distributed_type)
    return name if distributed_type == "NO" else f"{name}, {num_processes} processes"


def check_accelerator(accelerator, loss_weighted_by: str = "samples") -> None:
    """Refuse the launches Accelerate 1.15 accepts and then silently runs as something else.

    - fp16 without CUDA: it trains in fp32.
    - An engine this machine cannot run. Without CUDA GPUs, `accelerate launch` of an FSDP or
      DeepSpeed config starts the processes, but each builds a plain one-process run and trains on
      all the data, all of them writing the same --output_dir: torchrun's WORLD_SIZE gives it away.
      With ACCELERATE_USE_CPU=true the processes do form a group, but Accelerate turns its FSDP
      plugin on only for GPU groups, so an FSDP config runs DDP (MULTI_CPU): the engine the config
      named (ACCELERATE_USE_FSDP) is not the one that runs.

    And DeepSpeed, where it runs, steps inside `accelerator.backward`. The recipes now count each window
    before its backward (training/windows.py), which is the form the probe measured exact under real
    ZeRO-2 (benchmarks/deepspeed_cpu_probe.py: 1.0000004 of the full-batch gradient), but no recipe has
    run under DeepSpeed with it (it does not install here): recipes whose loss is a mean over tokens
    (`loss_weighted_by="tokens"`) stay refused, sample-weighted ones warned, until one has.
    """
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise ConfigError(
            "fp16 needs a CUDA GPU and this machine has none; launch with --mixed_precision no (or bf16), "
            "e.g. --config_file accelerate_configs/cpu.yaml"
        )
    requested = requested_engine()
    running = accelerator.distributed_type.value
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        engine = requested or "multi-GPU DDP"
        raise ConfigError(
            f"accelerate launch started {launched} processes for {engine}, but each one runs alone ({running}, "
            f"{accelerator.num_processes} process): this machine has no CUDA GPU for {engine}; on CPU use "
            "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N (DDP over gloo)"
        )
    if requested and running != requested:
        raise ConfigError(
            f"the Accelerate config asks for {requested}, but this launch would run {running}: Accelerate 1.15 "
            f"turns {requested} on only for CUDA GPU processes, so on {accelerator.device.type.upper()} it would silently "
            f"fall back to {running}; run the config on GPUs, or for CPU processes use "
            "ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N (DDP over gloo)"
        )
    if accelerator.distributed_type.value == "DEEPSPEED":
        # Before issue 54 the window scale came after the last backward, which DeepSpeed had already stepped on
        # (×31.25 for a causal LM, measured with real ZeRO-2 on 2 CPU processes; ×1.0000004 with the count known
        # before backward, the recipes' form now: deepspeed_cpu_probe.py). Refused until a recipe has run under it.
        if loss_weighted_by != "samples":
            raise ConfigError(
                f"DeepSpeed cannot run this recipe exactly: its loss is a mean over {loss_weighted_by}, and DeepSpeed steps inside "
                "accelerator.backward, before the recipe can divide by the window's count, so every update would be about "
                f"{loss_weighted_by}-per-sample times too large. Use DDP (accelerate_configs/multi_gpu_ddp.yaml) or FSDP (fsdp.yaml)"
            )
        accelerator.print(
            "warning: DeepSpeed has not run the recipes' counted windows here (each window's scale is set before its "
            "backward, the form measured exact under ZeRO-2, but untested in a recipe); DDP and FSDP are tested exact."
        )


def prepare_output_dir(
    output_dir: str | os.PathLike, *, resume: bool, overwrite: bool, is_main_process: bool = True
) -> None:
    """Check --output_dir before any compute is spent; with `overwrite`, clear the previous run's outputs.

    Refused without --overwrite_output_dir: a folder that holds a finished run (all_results.json),
    or the checkpoints of an unfinished one (which a fresh start would mix with its own). The checks
    only read, so every process makes them and fails alike; only the main process writes.
    """
    path = Path(output_dir)
    if resume and overwrite:
        raise ConfigError("--overwrite_output_dir and --resume_from_checkpoint contradict each other; give one")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--output_dir {path} is a file, not a folder; pick another --output_dir")
    if is_main_process:
        # First: a run still writing here must not have its files judged, let alone deleted (--overwrite_output_dir).
        _make_writable(path)
        lock_output_dir(path)
    if not resume and not overwrite:
        if (path / "all_results.json").exists():
            raise ConfigError(
                f"--output_dir {path} already holds a finished run (all_results.json); pass --overwrite_output_dir "
                "to replace it, or choose a new --output_dir"
            )
        if (path / "checkpoints").is_dir() and any((path / "checkpoints").iterdir()):
            raise ConfigError(
                f"--output_dir {path} holds the checkpoints of an unfinished run; add --resume_from_checkpoint latest "
                "to continue it, or --overwrite_output_dir to start over"
            )
    if not is_main_process:
        return
    if overwrite:
        for name in ("checkpoints", "final", "final_merged"):
            shutil.rmtree(path / name, ignore_errors=True)
        for name in ("metrics.jsonl", EVAL_METRICS_FILE, "all_results.json"):
            (path / name).unlink(missing_ok=True)


def _make_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"cannot write to --output_dir {path} ({exc.strerror or exc}); pick a folder you can write to"
        ) from exc


LOCK_FILE = ".ft_accum.lock"
_held_locks: dict[str, int] = {}


def lock_output_dir(output_dir: str | os.PathLike) -> None:
    """Hold an exclusive lock on `output_dir` for the rest of this run, or refuse naming the holder's PID.

    `flock(2)` on `output_dir/.ft_accum.lock`: the kernel releases it when the holder exits, however it
    exits (`kill -9` included), so a dead run never leaves a stale lock behind. Two runs in one folder
    would otherwise interleave metrics.jsonl and overwrite each other's checkpoints (issue 19).
    """
    import fcntl

    path = Path(output_dir).resolve()
    if str(path) in _held_locks:
        return
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"--output_dir {output_dir} is in use by another run (PID {holder}); wait for it to end or stop it, "
            "or choose another --output_dir (--overwrite_output_dir does not take a folder from a running run)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held_locks[str(path)] = fd


def release_output_locks() -> None:
    """Release the locks this process holds (a run's end; tests run several recipes in one process)."""
    while _held_locks:
        _, fd = _held_locks.popitem()
        os.close(fd)  # closing the only descriptor releases the flock


def append_metrics(output_dir: Path, record: dict[str, Any]) -> None:
    with open(Path(output_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(output_dir: Path, last_step: int) -> None:
    """Keep the lines up to `last_step`, of metrics.jsonl and eval_metrics.jsonl: on resume, the
    updates (and evaluations) after the checkpoint run again."""
    for path in (Path(output_dir) / "metrics.jsonl", Path(output_dir) / EVAL_METRICS_FILE):
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
            path.write_text("".join(line + "\n" for line in kept))


def save_final(
    accelerator, model, tokenizer, output_dir: Path, name: str = "final", extra_files: dict[str, str] | None = None
) -> Path:
    """`save_pretrained` (safetensors) of the unwrapped model and the tokenizer into output_dir/name, with
    `extra_files` ({relative path: text}, e.g. sentence-transformers' module files) written beside them.

    A peft model saves its adapter only. Call on every process: the state dict is gathered
    from all of them (FSDP, DeepSpeed) before the main process writes.
    """
    accelerator.wait_for_everyone()
    check_finite_parameters(accelerator.unwrap_model(model), f"{name}/")
    state_dict = without_tied_copies(accelerator.unwrap_model(model), accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        write_pretrained(accelerator.unwrap_model(model), tokenizer, output_dir, name, state_dict, extra_files)
    accelerator.wait_for_everyone()
    return Path(output_dir) / name


def without_tied_copies(model, state_dict: dict | None) -> dict | None:
    """`state_dict` without the second and later names of a tied parameter (T5's shared embedding
    under `encoder.embed_tokens` and `lm_head`, a tied output layer). FSDP's gathered state dict
    gives each name a tensor of its own, so `save_pretrained`, which drops a tie by its shared
    storage, wrote every copy; the first name is the one it keeps for an unsharded model."""
    if state_dict is None:
        return None
    seen, copies = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            copies.add(name)
        seen.add(id(param))
    return {key: value for key, value in state_dict.items() if key not in copies}


def write_pretrained(
    model,
    tokenizer,
    output_dir: Path,
    name: str,
    state_dict: dict | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """`save_pretrained` of model and tokenizer (and `extra_files`) into output_dir/name, whole or not at
    all: written to a temporary folder first, then renamed into place (one process only)."""
    tmp, final = Path(output_dir) / f".tmp-{name}", Path(output_dir) / name
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for relative, text in (extra_files or {}).items():
            (tmp / relative).parent.mkdir(parents=True, exist_ok=True)
            (tmp / relative).write_text(text)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"could not write {final} ({exc.strerror or exc}); free disk space, then resume with --resume_from_checkpoint latest"
        ) from exc
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def log_update(accelerator, output_dir: Path, record: dict[str, Any], progress, scheduler_steps: int = 1) -> None:
    """One update's record to metrics.jsonl (main process), the tracker, and the progress bar."""
    if accelerator.is_main_process:
        append_metrics(output_dir, record)
    accelerator.log(record, step=record["step"])
    progress.update(scheduler_steps)
    progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}")


def log_evaluation(accelerator, epoch: int, step: int, metrics: dict[str, Any]) -> None:
    """An evaluation (an epoch's end, or --eval_steps'): one printed line, the tracker, and a line of
    `eval_metrics.jsonl` in the output folder (what `ft-accum sweep`'s search reads as the run goes;
    metrics.jsonl keeps one line per update). Text values (an example output) are printed apart."""
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    accelerator.print(f"update {step} (epoch {epoch}): " + ", ".join(f"{k} {v:.4f}" for k, v in numbers.items()))
    for key, value in metrics.items():
        if key not in numbers:
            accelerator.print(f"  {key}: {value!r}")
    accelerator.log(numbers, step=step)
    if accelerator.is_main_process and accelerator.project_dir:
        with open(Path(accelerator.project_dir) / EVAL_METRICS_FILE, "a") as f:
            f.write(json.dumps({"epoch": epoch, "step": step, **numbers}) + "\n")


def write_results(
    accelerator, state, plan, *, output_dir: str, learning_rate: float, train_seconds: float, **metrics: Any
) -> dict[str, Any]:
    """all_results.json: the last evaluation plus the run's batch arithmetic, throughput and peak memory."""
    from ft_accum.training.memory import peak_memory_gb

    results = {
        **metrics,
        "train_runtime": train_seconds,
        "train_samples_per_second": state.samples_seen / train_seconds,
        "train_tokens_per_second": state.tokens_seen / train_seconds,
        "num_update_steps": state.step,
        "train_samples": state.samples_seen,
        "train_tokens": state.tokens_seen,
        "effective_batch_size": state.effective_batch_size,
        **batch_split(plan),
        "learning_rate": learning_rate,
        "mixed_precision": accelerator.mixed_precision,
        "distributed_type": accelerator.distributed_type.value,
        "engine": describe_engine(accelerator.distributed_type.value, accelerator.num_processes),
        "peak_memory_gb": peak_memory_gb(accelerator.device),
        # How often the job was started again: SLURM's requeues, torchrun's restarts (--max_restarts).
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
        "torchelastic_restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
    }
    if accelerator.is_main_process:
        (Path(output_dir) / "all_results.json").write_text(json.dumps(results, indent=2))
    return results


def save_merged_lora(accelerator, model, tokenizer, output_dir, *, base_name: str, base_in_4bit: bool) -> dict:
    """--merge_lora: the base with the LoRA adapter merged into final_merged/.

    A 4-bit base (--load_in_4bit) is not merged into: its weights would be dequantized, summed and
    quantized again, and that last rounding would undo most of the adapter's small changes. The
    adapter (final/) is merged into a bf16 copy of the original base, `base_name`, instead. That is
    lossy too, the other way round: the adapter was trained against the NF4-rounded base, and the
    merged model has the unrounded one, so its outputs differ a little from those of the trained
    pair. The run says so; keep final/ to serve the exact trained pair on the 4-bit base.
    """
    if not base_in_4bit:
        merged = accelerator.unwrap_model(model).merge_and_unload()
        save_final(accelerator, merged, tokenizer, output_dir, name="final_merged")
        return {}
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        from transformers import AutoModelForCausalLM

        from ft_accum.models.lora import import_peft

        peft = import_peft()
        base = AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.bfloat16)
        merged = peft.PeftModel.from_pretrained(base, os.path.join(output_dir, "final")).merge_and_unload()
        write_pretrained(merged, tokenizer, output_dir, "final_merged")
        accelerator.print(
            "final_merged/: the adapter merged into a bf16 copy of the base, not into its 4-bit weights (that would "
            "round the adapter's changes away); outputs differ a little from the trained 4-bit pair, which final/ keeps"
        )
    accelerator.wait_for_everyone()
    return {"merged_into": "bfloat16 copy of the base (lossy: trained against its NF4 rounding)"}
