"""Model calls outside the training loop under a sharded engine: every rank makes them.

Under FSDP (and DeepSpeed ZeRO-3) each forward all-gathers the parameters from every rank, so a
forward that one rank makes alone waits for the others for ever: a sample generated on the main
process only hung the causal-LM recipe after its last checkpoint (issue 42). Samples, generation-
based evaluation and merges therefore run on every rank, the same number of forwards on each; only
writing files and printing are main-process work.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
from accelerate.utils import DistributedType

T = TypeVar("T")
SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED)
# FSDP roots that have run a forward (every rank runs the same calls, so every rank's set agrees).
_ROOTS_RUN: weakref.WeakSet = weakref.WeakSet()


def generate(accelerator, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **generation_kwargs):
    """`generate()` of the prepared `model`, to be called on every rank with the same number of calls.

    Under FSDP three things differ from a plain model:
    - the root's forward must come first (see below);
    - `generate()` calls the inner model's forward, not the prepared root's, so the parameters the
      root unit holds itself (a final norm under a peft wrapper) would stay sharded: the root is
      unsharded for the call (FSDP2's `FSDPModule.unshard`, one all-gather) and resharded after.
    - `synced_gpus=True` (transformers turns it on by itself for FSDP1 and ZeRO-3, not for the FSDP2
      `fully_shard` that Accelerate applies): a rank whose sequences have all ended keeps stepping,
      its outputs thrown away, until every rank's have, so that each step's all-gather finds all ranks.
    """
    from torch.distributed.fsdp import FSDPModule

    sharded = accelerator.distributed_type in SHARDED and accelerator.num_processes > 1
    root = model if isinstance(model, FSDPModule) else None
    if root is not None:
        if root not in _ROOTS_RUN:
            # FSDP2 initialises itself at the first forward, which must be the root's: a run whose first model
            # call is generate() (GRPO's round) would start it at the embedding ("requires running forward
            # through the root module first"). One token through the root does it, once per model.
            decoder = {"decoder_input_ids": input_ids[:1, :1]} if model.config.is_encoder_decoder else {}
            with torch.no_grad():
                model(input_ids=input_ids[:1, :1], attention_mask=attention_mask[:1, :1], use_cache=False, **decoder)
            _ROOTS_RUN.add(root)
        root.unshard()
    try:
        # Under the training's autocast: unwrap_model drops the prepared forward's, and a model whose
        # frozen parts are stored in bf16 (the dtype policy) beside fp32 trained ones mixes dtypes.
        with accelerator.autocast():
            return accelerator.unwrap_model(model).generate(
                input_ids=input_ids, attention_mask=attention_mask, synced_gpus=sharded, **generation_kwargs
            )
    finally:
        if root is not None:
            root.reshard()


def rank_batches(
    items: Sequence[T], process_index: int, num_processes: int, batch_size: int
) -> Iterator[tuple[list[T], int]]:
    """This rank's share of `items` (every `num_processes`-th, from `process_index`) in batches of
    `batch_size`, as (batch, how many of its rows are real), with as many batches, of the same
    sizes, on every rank: where a rank's share runs out, its batch is filled with stand-ins (the
    first item), whose outputs the caller drops. No items: no batches, on every rank.

    batches per rank = ceil(ceil(len(items) / num_processes) / batch_size)
    """
    mine = list(items[process_index::num_processes])
    per_rank = -(-len(items) // num_processes)
    for start in range(0, per_rank, batch_size):
        real = mine[start : start + batch_size]
        size = min(batch_size, per_rank - start)
        yield real + [items[0]] * (size - len(real)), len(real)
