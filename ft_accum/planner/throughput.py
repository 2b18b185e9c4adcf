"""The planner's speed model: relative throughput of a split, the FLOPs per token, and what offloading's
copies cost. A heuristic for ranking candidates, not a measurement (benchmarks/ measure)."""

from __future__ import annotations

import torch

from ft_accum.planner.task_specs import build_model

# The speed model's two hardware assumptions, used only to price activation offloading's copies against
# compute (`relative_throughput`); `ft-accum plan --gpu_tflops/--pcie_gbps` override them.
ASSUMED_GPU_TFLOPS = 12.0  # sustained bf16 training throughput of a 12 GB consumer card, at full utilisation
ASSUMED_PCIE_GBPS = 20.0  # pinned host↔GPU copies over PCIe 4.0 x16 (31.5 GB/s in theory)


def passes_per_token(trains_base_weights: bool) -> int:
    """Forward + backward in units of one forward (2N FLOPs per token): 3 when the backward also
    computes weight gradients (4N), 2 when the base is frozen (LoRA, QLoRA: activation gradients only)."""
    return 3 if trains_base_weights else 2


def relative_throughput(
    micro_batch_size: int,
    seq_len: int,
    gradient_checkpointing: bool,
    saturation_tokens: int = 2048,
    *,
    trains_base_weights: bool = True,
    offloaded_bytes: float = 0.0,
    flops_per_token: float = 0.0,
    gpu_tflops: float = ASSUMED_GPU_TFLOPS,
    pcie_gbps: float = ASSUMED_PCIE_GBPS,
) -> float:
    """A heuristic, not a measurement: larger micro-batches keep the GPU busier, with diminishing returns.

    Tokens per second ∝ u = t / (t + saturation_tokens), with t = micro × seq_len tokens per micro-batch
    (half speed at 2048 tokens, a rough knee for 0.1–8B models on consumer GPUs); recomputation
    costs one extra forward (2N FLOPs per token): a third of a forward+backward (6N), hence × 3/4,
    or half of one when the base is frozen (LoRA: 4N, no weight gradients), hence × 2/3.

    With `offloaded_bytes` (per micro-batch, `low_memory.offload_activations`), the copies to host
    and back take 2 × bytes / PCIe bandwidth, and add to the compute time t × flops_per_token /
    (gpu_tflops × u × the checkpointing factor), since the recipes copy synchronously:
    speed × compute / (compute + copies).
    """
    tokens = micro_batch_size * seq_len
    passes = passes_per_token(trains_base_weights)
    recompute = passes / (passes + 1) if gradient_checkpointing else 1.0
    speed = tokens / (tokens + saturation_tokens) * recompute
    if not offloaded_bytes:
        return speed
    compute_seconds = tokens * flops_per_token / (gpu_tflops * 1e12 * speed)
    copy_seconds = 2 * offloaded_bytes / (pcie_gbps * 1e9)
    return speed * compute_seconds / (compute_seconds + copy_seconds)


def implied_copy_gbps(
    offloaded_bytes: float, micro_batch_size: int, samples_per_second: float, offloaded_samples_per_second: float
) -> float | None:
    """The copy bandwidth a measured offloading slowdown implies, in the terms of `relative_throughput`:
    2 × bytes / (seconds per micro-batch offloaded − without), in GB/s; None when offloading was not
    measurably slower (the copies hidden, or lost in noise). What `--pcie_gbps` should be on that machine.
    """
    extra_seconds = micro_batch_size / offloaded_samples_per_second - micro_batch_size / samples_per_second
    return 2 * offloaded_bytes / extra_seconds / 1e9 if extra_seconds > 0 else None


def training_flops_per_token(config, task: str, trains_base_weights: bool) -> float:
    """2N per token forward and 4N backward, with N the parameters used in matmuls (all but an untied
    input embedding): the 6N of Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1.
    A frozen base (LoRA, QLoRA) computes no weight gradients: 2N backward, 4N in all. Attention's
    T-dependent FLOPs are left out (small against 6N at the sequence lengths planned here)."""
    with torch.device("meta"):
        model = build_model(config, task)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    parameters = sum(p.numel() for p in model.parameters())
    if embedding is not None and (output is None or output.weight is not embedding.weight):
        parameters -= embedding.weight.numel()
    return 2 * parameters * passes_per_token(trains_base_weights)
