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


def free_memory(device: torch.device) -> None:
    """Return what the failed step held: drop Python references first, then the CUDA cache."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
