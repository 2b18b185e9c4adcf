"""GKD's on-policy sequences (issue 56): the student answers a fraction λ of the update's prompts itself.

Generalized knowledge distillation (Agarwal et al. 2024, arXiv:2306.13649, Algorithm 1) trains the
student on its own samples as well as on the data: with probability λ a sequence's answer is the
student's, sampled at the distillation temperature, and the teacher grades every token of it. Here
the decision and the sample belong to the sequence, not to the micro-batch:

    on-policy(i) = u(seed, update, i) < λ       (core.distillation_loss.student_samples)
    answer(i)    = sample of the student, seeded by generation_round.round_seed(seed, update, i),
                   from the prompt alone, unpadded, one sequence per generate() call

so an update holds the same sequences at any micro-batch size, accumulation or number of
processes (TRL's `GKDTrainer` draws `random.random() <= lmbda` once per micro-batch, and samples a
padded micro-batch together). It runs before the window is counted (`TrainWindows(prepare_batch=)`),
so the update's token count T includes the student's answers. The prompt is the row up to its last
assistant turn; earlier turns stay as the data has them and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft_accum.core.distillation_loss import student_samples
from ft_accum.core.errors import ConfigError
from ft_accum.data.chat_data import collate_chats
from ft_accum.training.every_rank import SHARDED
from ft_accum.training.generation_round import Sampling, round_seed, sample_prompts


@dataclass(frozen=True)
class OnPolicy:
    """How the student answers: λ, the run's seed, at most `max_new_tokens` (and `max_length` in all),
    sampled at `temperature`, stopping at `eos_token_id`; rows padded again with `pad_token_id`."""

    lmbda: float
    seed: int
    max_new_tokens: int
    max_length: int
    temperature: float
    eos_token_id: int
    pad_token_id: int

    def describe(self) -> str:
        """The banner's on-policy line."""
        return (
            f"each sequence with probability {self.lmbda:g} answered by the student itself "
            f"(≤ {self.max_new_tokens} tokens at τ {self.temperature:g}), decided per sequence"
        )


def with_row_index(rows: list[dict]) -> list[dict]:
    """The rows, each with its `row_index` (its place in the dataset): the sequence's identity in
    every micro-batch, whatever the split."""
    return [dict(row, row_index=index) for index, row in enumerate(rows)]


def last_answer_start(labels: list[int]) -> int:
    """Where the last assistant turn starts: the first position of the last run of labelled tokens."""
    end = max(i for i, label in enumerate(labels) if label != -100)
    start = end
    while start > 0 and labels[start - 1] != -100:
        start -= 1
    return start


def unpadded_rows(batch: dict) -> list[dict]:
    """A right-padded micro-batch (`chat_data.collate_chats`) back into its rows."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    ids, labels, index = batch["input_ids"].tolist(), batch["labels"].tolist(), batch["row_index"].tolist()
    return [{"input_ids": i[:n], "labels": y[:n], "row_index": r} for i, y, r, n in zip(ids, labels, index, lengths)]


@torch.no_grad()
def with_student_answers(accelerator, model, batch: dict, update: int, settings: OnPolicy) -> tuple[dict, int]:
    """(`batch` with the on-policy rows' last answer replaced by the student's own, how many rows
    that is); a batch with none comes back as it was. The student samples in eval mode (no dropout).
    A prompt that leaves no room under `max_length` keeps the data's answer."""
    rows = unpadded_rows(batch)
    chosen = student_samples(settings.seed, update, [row["row_index"] for row in rows], settings.lmbda)
    if not any(chosen):
        return batch, 0
    was_training, answered = model.training, 0
    model.eval()
    for row, on_policy in zip(rows, chosen):
        prompt = row["input_ids"][: last_answer_start(row["labels"])]
        room = min(settings.max_new_tokens, settings.max_length - len(prompt))
        if not on_policy or room < 1:
            continue
        sampling = Sampling(1, room, settings.temperature, 1.0, settings.eos_token_id, settings.pad_token_id)
        seed = round_seed(settings.seed, update, row["row_index"])
        ((answer, _truncated),) = sample_prompts(accelerator, model, [prompt], sampling, seed)[0]
        row["input_ids"], row["labels"] = prompt + answer, [-100] * len(prompt) + answer
        answered += 1
    model.train(was_training)
    batch = collate_chats(settings.pad_token_id, packed=False)(rows)
    return {key: value.to(accelerator.device) for key, value in batch.items()}, answered


class StudentAnswers:
    """`TrainWindows(prepare_batch=StudentAnswers(accelerator, model, settings))`: each micro-batch of
    real rows with its on-policy answers (`with_student_answers`); `columns()` at the update's end
    gives metrics.jsonl's `on_policy_sequences` (on all processes) and starts the next count."""

    def __init__(self, accelerator, model, settings: OnPolicy):
        if settings.lmbda and accelerator.distributed_type in SHARDED and accelerator.num_processes > 1:
            # Each rank samples its own rows, one generate() each: unequal calls would hang a sharded model.
            raise ConfigError(
                "--lmbda samples the student's answers on each process alone, which a sharded engine (FSDP, "
                "DeepSpeed ZeRO-3) cannot do; launch with DDP (accelerate_configs/multi_gpu_ddp.yaml) or drop --lmbda"
            )
        self.accelerator, self.model, self.settings = accelerator, model, settings
        self.sequences = 0

    def __call__(self, batch: dict, update: int) -> dict:
        if not self.settings.lmbda:
            return batch
        batch, answered = with_student_answers(self.accelerator, self.model, batch, update, self.settings)
        self.sequences += answered
        return batch

    def columns(self) -> dict[str, int]:
        if not self.settings.lmbda:
            return {}
        count = torch.tensor([self.sequences], device=self.accelerator.device)
        self.sequences = 0
        return {"on_policy_sequences": int(self.accelerator.reduce(count, reduction="sum").item())}
