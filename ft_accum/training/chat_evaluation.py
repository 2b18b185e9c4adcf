"""Exact match of a chat model's greedy answers, on every rank (the instruction-tuning and distillation recipes).

The questions whose reference answer has at most `max_words` words (BBC News's one-word topics) are
answered greedily after the model's chat template; an answer scores when it equals the reference
after lower-casing and dropping punctuation. The same number of `generate()` calls runs on every rank
(training/every_rank.py: under FSDP each step all-gathers the weights).
"""

from __future__ import annotations

import re

import torch

from ft_accum.training import every_rank


def normalize(text: str) -> str:
    """Lower case, punctuation as spaces, single spaces: "Sport." and "sport" match."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


@torch.no_grad()
def exact_match(accelerator, model, tokenizer, conversations: list, *, max_words: int, max_new_tokens: int) -> float:
    """The fraction of short-answer conversations whose greedy answer equals the reference, over all ranks."""
    short = [(c[:-1], c[-1]["content"]) for c in conversations if len(c[-1]["content"].split()) <= max_words]

    def encode(prompts: list) -> dict:
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        # Not all of it: a BERT-style tokenizer adds token_type_ids, which a causal LM's generate() refuses.
        return {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}

    return greedy_exact_match(accelerator, model, tokenizer, short, encode, max_new_tokens=max_new_tokens)


@torch.no_grad()
def greedy_exact_match(accelerator, model, tokenizer, items: list, encode, *, max_new_tokens: int) -> float:
    """The fraction of `items`, (prompt, reference answer) pairs, whose greedy answer equals the
    reference (`normalize`d), over all ranks; `encode(prompts)` gives the model's inputs for a batch
    of prompts, left-padded (a vision-language model's images included)."""
    tokenizer.padding_side, hits, count = "left", 0, 0  # generation continues from the right end of each prompt
    for chunk, real in every_rank.rank_batches(items, accelerator.process_index, accelerator.num_processes, 8):
        inputs = {k: v.to(accelerator.device) for k, v in encode([prompt for prompt, _ in chunk]).items()}
        generated = every_rank.generate(
            accelerator,
            model,
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        answers = tokenizer.batch_decode(generated[:real, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        hits += sum(normalize(a) == normalize(reference) for a, (_, reference) in zip(answers, chunk))
        count += real
    tokenizer.padding_side = "right"
    hits, count = accelerator.reduce(torch.tensor([hits, count], device=accelerator.device), "sum").tolist()
    return hits / max(count, 1)
