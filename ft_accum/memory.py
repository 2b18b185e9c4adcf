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
