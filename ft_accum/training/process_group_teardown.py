"""The process group is destroyed after a recipe's `train()` has released its locals, not by them.

A deadlock at a DDP run's end, every output written (torch 2.13, gloo; seen twice in this suite,
reproduced and caught in gdb by tests/test_process_group_teardown.py's loop):
- the main thread releases `train()`'s DDP model, and with it DDP's `Reducer`, whose reference to
  the process group is the last one once `end_training()` has destroyed the group. pybind releases
  the Reducer with the GIL held, so `~ProcessGroupGloo` joins the group's worker threads holding it;
- a worker thread that is still releasing its last finished collective (a barrier, holding the
  collectives before it) frees tensors that Python made, and freeing their Python objects takes
  the GIL (`TensorImpl::decref_pyobject`).
Each waits for the other and the launcher never exits. pytorch/pytorch#56297 is this class of
deadlock; c10d binds the Python `ProcessGroup` with a destructor that releases the GIL first, so
a reference to the group kept past `train()` and released after it (`run_main`) is the last one,
and the worker finishes its release while the group's destructor waits for it.
"""

from __future__ import annotations

_kept_groups: list = []


def keep_process_group() -> None:
    """Hold the default process group (if any) until `release_process_group()`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        _kept_groups.append(dist.group.WORLD)


def end_training(accelerator) -> None:
    """`accelerator.end_training()` (trackers finished, the process group destroyed), the group kept
    until `release_process_group()`: every end of a run (RunTracker.finish, the graceful stop) calls this."""
    keep_process_group()
    accelerator.end_training()


def release_process_group() -> None:
    """Drop the groups `keep_process_group` holds, after the recipe's locals are gone (run_main)."""
    _kept_groups.clear()
