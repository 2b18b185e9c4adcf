"""DPO's reference log-probabilities, computed once before training (`--precompute_ref_log_probs`).

DPO's reference is the policy as it starts (Rafailov et al. 2023, arXiv:2305.18290, §4). Before
its first update the policy *is* that reference, so one pass over the pairs then gives every
reference log-probability the run needs, and full fine-tuning keeps no frozen second copy of the
model: the memory of one model instead of two, for one extra forward pass per pair (TRL's
`precompute_ref_log_probs` makes the same trade).

The values are stored per pair, [pairs, 2] (chosen, rejected), in
`output_dir/reference_log_probs.safetensors`: written whole under a temporary name and then
renamed, so the file is complete or absent. A resumed run reads them: recomputing them from weights
that have moved would give a different reference.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ft_accum.core.errors import ConfigError

FILE = "reference_log_probs.safetensors"


@torch.no_grad()
def compute(model, rows: list[dict], collate, batch_size: int, device, output_loss) -> torch.Tensor:
    """[len(rows), 2]: each pair's (chosen, rejected) response log-probs under `model`, `batch_size`
    pairs at a time, in eval mode (no dropout). `output_loss` is the run's `OutputLoss`."""
    from ft_accum.data.chat_data import stacked_pairs

    was_training = model.training
    model.eval()
    values = []
    for start in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[start : start + batch_size]).items()}
        labels, inputs = stacked_pairs(batch)
        log_probs = -output_loss.per_row(model, labels, **inputs)[0]
        values.append(log_probs.view(2, -1).T.float().cpu())
    model.train(was_training)
    return torch.cat(values)


def precompute(
    output_dir: str | Path, accelerator, resumed: bool, model, splits: dict[str, list[dict]], collate, batch_size: int,
    output_loss,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """{split: [pairs, 2]} from `output_dir`'s file, else `compute` over each split's tokenized pairs
    (`chat_data.tokenize_pairs` rows) on every process (each computes all pairs: no process waits
    for another's shard), saved by the main process.

    A resumed run without the file stops with one line: its policy is no longer the reference."""
    from safetensors.torch import load_file, save_file

    path = Path(output_dir) / FILE
    if path.is_file():
        return load_file(str(path))
    if resumed:
        raise ConfigError(
            f"--precompute_ref_log_probs: {path} is missing, and this run resumes from a checkpoint whose "
            "weights are no longer the reference; copy the file back from the run's first output folder, or start "
            "the run again"
        )
    values = {split: compute(model, rows, collate, batch_size, accelerator.device, output_loss)
              for split, rows in splits.items()}  # fmt: skip
    if accelerator.is_main_process:
        tmp = path.with_name(f".{FILE}.tmp")
        save_file({k: v.contiguous() for k, v in values.items()}, str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    accelerator.wait_for_everyone()
    return values


def lookup(values: torch.Tensor, pair_index: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (chosen, rejected) reference log-probs of a micro-batch's pairs, by their index in the split."""
    rows = values[pair_index.cpu()].to(device)
    return rows[:, 0], rows[:, 1]
