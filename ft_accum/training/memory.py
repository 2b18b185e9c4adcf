"""Peak memory of the current process, for run reports and benchmarks."""

from __future__ import annotations

import resource
import sys

import torch

from ft_accum.core.batch_arithmetic import apply_batch_plan


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


class OutOfMemoryRetry:
    """`--auto_micro_batch`: after an out-of-memory error inside an accumulation window, retry the
    same update with smaller micro-batches.

    The optimizer has not stepped in this window, so its partial gradients are dropped; the plan
    shrinks (`BatchPlan.shrunk`: the same effective batch, hence the same LR). The sample order does
    not depend on the split (seedable sampler), so the loop re-enters the epoch at its last
    completed update and every later update sees exactly the samples it would have. One process
    only: with several, an OOM on one rank alone would leave the others waiting in a collective.
    """

    def __init__(self, enabled: bool, seed: int):
        self.enabled, self.seed = enabled, seed
        self._retrying = False

    def retrying_epoch(self) -> bool:
        """True once after `recover`: the loop re-enters the same epoch at its last completed update."""
        retrying, self._retrying = self._retrying, False
        return retrying

    def recover(self, exc: RuntimeError, accelerator, optimizer, train_dataloader, plan):
        """Re-raise `exc` unless it is an OOM this retry handles; else (new dataloader, new plan)."""
        if not (self.enabled and is_out_of_memory(exc)):
            raise exc
        from ft_accum.data.data_sources import seeded_train_dataloader

        optimizer.zero_grad(set_to_none=True)
        free_memory(accelerator.device)
        smaller = apply_batch_plan(accelerator, plan.shrunk())
        dataloader = accelerator.prepare(
            seeded_train_dataloader(train_dataloader.dataset, train_dataloader.collate_fn, smaller.micro, self.seed)
        )
        self._retrying = True
        accelerator.print(
            f"out of memory at micro-batch {plan.micro}: now {smaller.describe()}, the same effective batch; "
            "retrying the update"
        )
        return dataloader, smaller
