"""Peak memory of the current process, for run reports and benchmarks."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak bytes allocated by PyTorch on a CUDA device, else the process's peak RSS, in GiB.

    CUDA: `torch.cuda.max_memory_allocated` (tensors only; the caching allocator and the CUDA
    context add more). CPU: `ru_maxrss`, which Linux reports in KiB and macOS in bytes.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


_OOM_MESSAGES = ("out of memory", "can't allocate memory", "DefaultCPUAllocator", "CUBLAS_STATUS_ALLOC_FAILED")


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA OOM (`torch.OutOfMemoryError`) or an allocator refusal reported as a RuntimeError
    (the CPU allocator: "DefaultCPUAllocator: can't allocate memory"; cuBLAS workspace failures)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


def shrink_micro_batch(per_device_train_batch_size: int, gradient_accumulation_steps: int) -> tuple[int, int]:
    """Divide the micro-batch by its smallest prime factor p (2 when even) and multiply the
    accumulation by p: micro × accumulation, hence the effective batch and the LR, stay the same."""
    from ft_accum.errors import ConfigError

    if per_device_train_batch_size <= 1:
        raise ConfigError(
            "out of memory at micro-batch 1, so the micro-batch cannot shrink further; try --gradient_checkpointing, "
            "a shorter --max_seq_length/--block_size, LoRA, or bf16 (ft-accum plan predicts what fits)"
        )
    p = next(d for d in range(2, per_device_train_batch_size + 1) if per_device_train_batch_size % d == 0)
    return per_device_train_batch_size // p, gradient_accumulation_steps * p


def free_memory(device: torch.device) -> None:
    """Return what the failed step held: drop Python references first, then the CUDA cache."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def retry_with_smaller_micro_batch(accelerator, optimizer, train_dataloader, per_device_train_batch_size: int,
                                   gradient_accumulation_steps: int, seed: int):
    """After an out-of-memory error inside an accumulation window: the same update, smaller micro-batches.

    The optimizer has not stepped in this window, so its partial gradients are dropped; the
    micro-batch shrinks and the accumulation grows by the same factor (`shrink_micro_batch`), so
    the effective batch and the LR do not change. The sample order does not depend on the split
    (seedable sampler), so the caller re-enters the epoch at its last completed update and every
    later update sees exactly the samples it would have. Returns (train_dataloader, micro, accumulation).
    """
    from ft_accum.data_sources import seeded_train_dataloader

    optimizer.zero_grad(set_to_none=True)
    free_memory(accelerator.device)
    micro, accumulation = shrink_micro_batch(per_device_train_batch_size, gradient_accumulation_steps)
    accelerator.gradient_accumulation_steps = accumulation
    accelerator.step = 0  # the window restarts
    dataloader = accelerator.prepare(seeded_train_dataloader(train_dataloader.dataset, train_dataloader.collate_fn, micro, seed))
    accelerator.print(f"out of memory at micro-batch {per_device_train_batch_size}: now {micro} micro × {accumulation} accumulation "
                      f"× {accelerator.num_processes} process(es), the same effective batch; retrying the update")
    return dataloader, micro, accumulation
