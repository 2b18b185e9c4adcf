"""Rows of several texts (anchor, positive, negative) tokenized and padded column by column.

A bi-encoder embeds each column on its own, so each is its own `input_ids` / `attention_mask` pair,
`{column}_input_ids` and `{column}_attention_mask`, padded to the longest text of that column in the
micro-batch only (a short headline is not padded to a passage's length).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def tokenize_columns(tokenizer, rows: dict, columns: Sequence[str], max_length: int) -> dict[str, list]:
    """`datasets.map(batched=True)`'s function: each column's texts → `{column}_input_ids`, `{column}_attention_mask`."""
    encoded = {}
    for column in columns:
        tokens = tokenizer(rows[column], truncation=True, max_length=max_length)
        encoded[f"{column}_input_ids"], encoded[f"{column}_attention_mask"] = (
            tokens["input_ids"],
            tokens["attention_mask"],
        )
    return encoded


class PadEachColumn:
    """The collator: each column padded to its own longest row (`tokenizer.pad`), as tensors."""

    def __init__(self, tokenizer, columns: Sequence[str], pad_to_multiple_of: int | None = None):
        self.tokenizer, self.columns, self.pad_to_multiple_of = tokenizer, tuple(columns), pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = {}
        for column in self.columns:
            padded = self.tokenizer.pad(
                [
                    {"input_ids": r[f"{column}_input_ids"], "attention_mask": r[f"{column}_attention_mask"]}
                    for r in rows
                ],
                pad_to_multiple_of=self.pad_to_multiple_of,
                return_tensors="pt",
            )
            batch[f"{column}_input_ids"], batch[f"{column}_attention_mask"] = (
                padded["input_ids"],
                padded["attention_mask"],
            )
        return batch
