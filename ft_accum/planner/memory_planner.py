"""`ft-accum plan`: every exact split of the effective batch, with and without checkpointing (and, where
allowed, offloading), its predicted peak (planner/tracing.py), whether it fits the card with a margin,
and its relative speed (planner/throughput.py); the fastest that fits is recommended, as a whole
launch line (planner/launch_line.py). What each task traces is its `TaskSpec` (planner/task_specs.py).

The candidate micro-batches that are powers of two, plus the smallest and largest, are traced, and
the rest interpolated linearly between them (forward+backward memory is near linear in the
micro-batch; never extrapolated, since the moment of the peak can move outside the traced range).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from ft_accum.core.batch_arithmetic import micro_batches_for
from ft_accum.core.errors import ConfigError
from ft_accum.models.layer_selection import student_config
from ft_accum.models.loading import check_context_length
from ft_accum.planner.configs import load_model_config
from ft_accum.planner.launch_line import launch_line
from ft_accum.planner.task_specs import PREFERENCE_LOSSES, TASK_SPECS, embedding_cache_bytes, task_spec
from ft_accum.planner.throughput import (
    ASSUMED_GPU_TFLOPS,
    ASSUMED_PCIE_GBPS,
    relative_throughput,
    training_flops_per_token,
)
from ft_accum.planner.tracing import CATEGORIES, GIB, MemoryEstimate, trace_micro_batches, trace_step

CUDA_OVERHEAD_GIB = 0.6  # CUDA context + cuBLAS workspace, measured as 0.4–0.6 GiB on recent drivers
FRAGMENTATION = 1.10  # the caching allocator reserves ~5–15% more than it hands out under training churn


def estimate_peak_memory(
    model: str | Any,
    *,
    task: str = "causal_lm",
    micro_batch_size: int = 1,
    seq_len: int = 512,
    precision: str = "fp32",
    optimizer: str = "adamw",
    lora_r: int | None = None,
    lora_target_modules: str = "all-linear",
    gradient_checkpointing: bool = False,
) -> MemoryEstimate:
    """The predicted peak of one training step, by category (see the module docstring for the method)."""
    return trace_step(
        load_model_config(model),
        task=task,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        precision=precision,
        optimizer=optimizer,
        lora_r=lora_r,
        lora_target_modules=lora_target_modules,
        gradient_checkpointing=gradient_checkpointing,
    )


def predict_micro_batches(config, micro_batch_sizes: list[int], **settings) -> dict[int, MemoryEstimate]:
    """The predicted peak for each micro-batch size: traced at the smallest and largest size and at
    2 and 8 where they are candidates, interpolated linearly in between (forward+backward memory
    is near linear in m; the interpolation errs high by ≤ 3% in the tests). Never extrapolated:
    outside the traced points the moment of the peak can move."""
    sizes = sorted(set(micro_batch_sizes))
    traced_sizes = sorted({m for m in sizes if m in (2, 8)} | {sizes[0], sizes[-1]})
    traced = trace_micro_batches(config, traced_sizes, **settings)
    predicted = {}
    for m in sizes:
        if m in traced:
            predicted[m] = max(traced[m], key=lambda e: e.peak)
            continue
        # Interpolate the forward+backward phase; the optimizer step's peak does not depend on m.
        low = max(t for t in traced_sizes if t < m)
        high = min(t for t in traced_sizes if t > m)
        w = (m - low) / (high - low)
        backward = MemoryEstimate(
            **{
                c: (1 - w) * getattr(traced[low][0], c) + w * getattr(traced[high][0], c)
                for c in (*CATEGORIES, "host_offloaded")
            }
        )
        predicted[m] = max(backward, traced[low][1], key=lambda e: e.peak)
    return predicted


def fits(peak_bytes: float, gpu_memory_bytes: float) -> bool:
    """peak × FRAGMENTATION + CUDA_OVERHEAD_GIB ≤ the card's memory."""
    return peak_bytes * FRAGMENTATION + CUDA_OVERHEAD_GIB * GIB <= gpu_memory_bytes


def candidate_micro_batches(effective_batch_size: int, num_processes: int = 1) -> list[int]:
    """Micro-batches that split the effective batch exactly (`batch_arithmetic.micro_batches_for`)."""
    return micro_batches_for(effective_batch_size, num_processes)


def refuse_other_tasks_settings(task: str, own: tuple[str, ...], **given: bool) -> None:
    """A task setting given for a task that does not take it is one line naming its task: the plan would
    otherwise ignore it (DEVELOPERS.md: a flag is honoured or refused, never silently ignored)."""
    stray = [name for name, is_given in given.items() if is_given and name not in own]
    if stray:
        owners = {name: next(t for t, spec in TASK_SPECS.items() if name in spec.settings) for name in stray}
        flags = ", ".join(f"--{'loss' if n == 'preference_loss' else n} (--task {owners[n]})" for n in stray)
        raise ConfigError(f"{flags}: not a setting of --task {task}; drop it, or plan that task")


def plan(
    model: str | Any,
    *,
    task: str,
    seq_len: int,
    effective_batch_size: int,
    gpu_memory_gib: float,
    num_processes: int = 1,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    lora_r: int | None = None,
    lora_target_modules: str = "all-linear",
    attention: str = "fused",
    loss_path: str = "chunked",
    load_in_4bit: bool = False,
    offload_activations: bool = False,
    host_memory_gib: float | None = None,
    gpu_tflops: float = ASSUMED_GPU_TFLOPS,
    pcie_gbps: float = ASSUMED_PCIE_GBPS,
    preference_loss: str = "dpo",
    precompute_ref_log_probs: bool = False,
    completion_length: int | None = None,
    student_layers: int | None = None,
    image_size: int | None = None,
    images_per_sample: int = 1,
    train_vision_tower: bool = False,
    recipe: str | Path | None = None,
) -> dict[str, Any]:
    """Every exact split of the effective batch, with and without checkpointing: predicted peak, fit, speed.
    The step traced is the `training_step` of `recipe` (default: the task's shipped recipe file).

    The recommendation is the fastest candidate that fits (ties go to the larger micro-batch).
    `offload_activations` allows offloading, and the planner decides where: it only adds copies, so
    a split is also traced with it only where the split does not fit without it, and its copies are
    priced against compute (`relative_throughput`, with `gpu_tflops` and `pcie_gbps`). An offloaded
    candidate fits only if its host bytes also stay within 80% of `host_memory_gib` (the rest is the
    OS, the data and Python).

    `task="preference"` plans recipes/preference_tuning.py: `effective_batch_size` counts pairs, each
    two sequences of `seq_len`, and DPO's reference is priced as `trace_micro_batches` says.
    `task="grpo"` plans recipes/grpo.py: `effective_batch_size` counts completions, each `seq_len`
    tokens of which the last `completion_length` (the recipe's --max_completion_length) are scored.
    `task="contrastive"` plans recipes/contrastive_embedding.py: `effective_batch_size` counts pairs (an
    anchor and a positive of `seq_len` tokens each), and every candidate holds the update's embedding
    cache (`embedding_cache_bytes`). Its speed leaves out GradCache's extra forward of each micro-batch:
    the same for every split but the one of a single micro-batch, which skips it.
    `task="distillation"` plans recipes/distillation.py: `model` is the teacher, the student its
    `student_layers` (default half); a sample is a conversation of `seq_len` tokens, all counted.

    `task="vision_language"` plans recipes/vision_language.py: a sample is a conversation of `seq_len`
    tokens that opens with `images_per_sample` images of `image_size` px (their placeholder tokens count
    in `seq_len`, as in the recipe's --max_seq_length); the model's own forward runs, vision tower
    included, frozen unless `train_vision_tower`. The result says how many tokens an image is.
    """
    if preference_loss not in PREFERENCE_LOSSES:
        raise ConfigError(f"--loss must be one of {', '.join(PREFERENCE_LOSSES)}, got {preference_loss!r}")
    for name, value in (("--gpu_tflops", gpu_tflops), ("--pcie_gbps", pcie_gbps)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be a positive number, got {value:g}; leave it out for the default")
    config = load_model_config(model)
    # The recipes refuse a sequence longer than the model's positions; so must the plan (issue 19).
    check_context_length(config.get_text_config(), seq_len, "--seq_len")
    micros = candidate_micro_batches(effective_batch_size, num_processes)
    spec = task_spec(task)
    refuse_other_tasks_settings(
        task,
        spec.settings,
        preference_loss=preference_loss != "dpo",
        precompute_ref_log_probs=precompute_ref_log_probs,
        completion_length=completion_length is not None,
        student_layers=student_layers is not None,
        image_size=image_size is not None,
        images_per_sample=images_per_sample != 1,
        train_vision_tower=train_vision_tower,
    )
    offered = {
        "preference_loss": preference_loss,
        "precompute_ref_log_probs": precompute_ref_log_probs,
        "completion_length": min(completion_length or seq_len, seq_len - 1),  # a prompt has ≥ 1 token
        "student_layers": student_layers,
        "image_size": image_size,
        "images_per_sample": images_per_sample,
        "train_vision_tower": train_vision_tower,
    }
    task_settings = {name: offered[name] for name in spec.settings}
    image_notes = image_plan(config, seq_len, image_size, images_per_sample) if "image_size" in spec.settings else {}
    settings = {
        "task": task,
        "seq_len": seq_len,
        "precision": precision,
        "optimizer": optimizer,
        "lora_r": lora_r,
        "lora_target_modules": lora_target_modules,
        "attention": attention,
        "loss_path": loss_path,
        "load_in_4bit": load_in_4bit,
        "recipe": str(recipe) if recipe else None,
        **task_settings,
    }
    tokens_per_sample = seq_len * spec.sequences_per_sample
    card = gpu_memory_gib * GIB
    cache = embedding_cache_bytes(effective_batch_size, config.hidden_size) if spec.embedding_cache else 0.0

    def predict(micro_batch_sizes, **features):
        estimates = predict_micro_batches(config, micro_batch_sizes, **features, **settings)
        return {
            m: replace(e, activations_gradients_temporaries=e.activations_gradients_temporaries + cache)
            for m, e in estimates.items()
        }

    # predicted[(gradient_checkpointing, offload_activations)][micro]
    predicted = {(False, False): predict(micros, gradient_checkpointing=False)}
    smallest = predicted[(False, False)][micros[0]]  # traced: the smallest candidate always is
    static = smallest.parameters + smallest.optimizer_state
    if not fits(static, card):
        options = [
            *(["--lora_r 16"] if not lora_r else []),
            *(["--optimizer adamw_8bit or sgd"] if optimizer == "adamw" else []),
            *(["--precision bf16 (weights in bf16)"] if precision != "bf16" else []),
            *(["--load_in_4bit (with --lora_r)"] if not load_in_4bit else []),
            "a smaller model",
        ]
        raise ConfigError(
            f"the weights and optimizer state alone need {static / GIB:.1f} GiB, more than a {gpu_memory_gib:g} GiB card holds "
            f"with its margin ({FRAGMENTATION}× + {CUDA_OVERHEAD_GIB} GiB); try {', '.join(options)}"
        )
    predicted[(True, False)] = predict(micros, gradient_checkpointing=True)
    if offload_activations:
        for checkpointing in (False, True):
            needed = [m for m in micros if not fits(predicted[(checkpointing, False)][m].peak, card)]
            if needed:
                predicted[(checkpointing, True)] = predict(
                    needed, gradient_checkpointing=checkpointing, offload_activations=True
                )
    if spec.frozen_teacher:  # the student trains (6N), the teacher runs its forward (2N of a frozen model's 4N)
        flops_per_token = (
            training_flops_per_token(student_config(config, student_layers), task, trains_base_weights=not lora_r)
            + training_flops_per_token(config, task, trains_base_weights=False) / 2
        )
    else:
        flops_per_token = training_flops_per_token(config, task, trains_base_weights=not lora_r)
    rows = []
    for (checkpointing, offloaded), estimates in sorted(predicted.items()):
        for micro, estimate in estimates.items():
            rows.append(
                {
                    "per_device_train_batch_size": micro,
                    "gradient_accumulation_steps": effective_batch_size // (micro * num_processes),
                    "gradient_checkpointing": checkpointing,
                    "offload_activations": offloaded,
                    "peak_gib": estimate.peak / GIB,
                    "fits": fits(estimate.peak, card)
                    and (not offloaded or estimate.host_offloaded <= 0.8 * (host_memory_gib or math.inf) * GIB),
                    "relative_throughput": relative_throughput(
                        micro,
                        tokens_per_sample,
                        checkpointing,
                        trains_base_weights=not lora_r,
                        offloaded_bytes=estimate.host_offloaded,
                        flops_per_token=flops_per_token,
                        gpu_tflops=gpu_tflops,
                        pcie_gbps=pcie_gbps,
                    ),
                    "host_gib": estimate.host_offloaded / GIB,
                    "breakdown_gib": estimate.as_gib(),
                }
            )
    rows.sort(key=lambda r: (r["gradient_checkpointing"], r["per_device_train_batch_size"], r["offload_activations"]))
    fitting = [r for r in rows if r["fits"]]
    best = (
        max(
            fitting,
            key=lambda r: (r["relative_throughput"], r["per_device_train_batch_size"], not r["offload_activations"]),
        )
        if fitting
        else None
    )
    if best and best["offload_activations"]:
        # What the copies cost, at the assumed bandwidth: the same split's speed without them.
        uncopied = relative_throughput(
            best["per_device_train_batch_size"],
            tokens_per_sample,
            best["gradient_checkpointing"],
            trains_base_weights=not lora_r,
        )
        best["offload_slowdown"] = 1 - best["relative_throughput"] / uncopied
    top = max(r["relative_throughput"] for r in rows)
    for r in rows:
        r["relative_throughput"] = r["relative_throughput"] / top
    result = {
        "model": getattr(config, "name_or_path", "") or str(model),
        "task": task,
        "seq_len": seq_len,
        "effective_batch_size": effective_batch_size,
        "num_processes": num_processes,
        "precision": precision,
        "optimizer": optimizer,
        "lora_r": lora_r,
        "attention": attention,
        "loss_path": loss_path,
        "load_in_4bit": load_in_4bit,
        "offload_activations": offload_activations,
        "recipe": str(recipe) if recipe else None,
        **task_settings,
        **image_notes,
        "gpu_tflops": gpu_tflops,
        "pcie_gbps": pcie_gbps,
        "training_flops_per_token": flops_per_token,
        "gpu_memory_gib": gpu_memory_gib,
        "margin": f"peak × {FRAGMENTATION} + {CUDA_OVERHEAD_GIB} GiB ≤ card",
        "candidates": rows,
        "recommended": best,
    }
    result["launch"] = launch_line(result)
    return result


def image_plan(config, seq_len: int, image_size: int | None, images_per_sample: int) -> dict[str, Any]:
    """What a vision-language plan states beside its table: the image size, its tokens, their share of a
    sample, and the vision tower's parameters; one line where the images leave no room for text."""
    import torch

    from ft_accum.models import vision_language
    from ft_accum.planner.task_specs import build_model
    from ft_accum.planner.vision_inputs import image_layout, image_prefix

    if images_per_sample < 1:
        raise ConfigError(f"--images_per_sample must be ≥ 1, got {images_per_sample}")
    layout = image_layout(config, image_size)
    image_prefix(config, layout, images_per_sample, seq_len)  # room for text after the images, else one line
    with torch.device("meta"):
        model = build_model(config, "vision_language")
    tower = vision_language.part_name(model, vision_language.VISION_TOWERS, "vision tower")
    return {
        "image_size": layout.image_size,
        "image_tokens_per_image": layout.tokens_per_image,
        "vision_tower_parameters": sum(p.numel() for n, p in model.named_parameters() if n.startswith(f"{tower}.")),
    }


def parse_memory(text: str) -> float:
    """'12GiB', '12 GB', '11.5' → GiB as a float (GB is read as GiB: cards are sold in binary units)."""
    cleaned = text.strip().lower().replace(" ", "")
    for suffix in ("gib", "gb", "g"):
        if cleaned.endswith(suffix):
            cleaned = cleaned[: -len(suffix)]
            break
    try:
        value = float(cleaned)
    except ValueError as exc:
        raise ConfigError(f"--gpu_memory {text!r} is not a size; write it like 12GiB or 11.5") from exc
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--gpu_memory must be positive, got {text!r}")
    return value
