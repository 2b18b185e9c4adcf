"""The generation round of online RL (issue 43): G sampled completions per prompt, the same whatever
the micro-batch, the accumulation or the number of processes.

Each prompt's G completions come from one `generate()` call of their own, seeded by (seed, round,
prompt index) inside `torch.random.fork_rng`, so they depend on the prompt and the seed only: not
on which process generates it, nor on what else is generated, nor on the batch the other prompts
are in (one prompt per call also means no padding between prompts to change the numbers), and the
training RNG stream is left as it was. On several processes each generates its share of the
prompts (`every_rank.rank_batches`: the same number of calls on every rank, as FSDP needs), and the
round is gathered, in prompt order, on every process.

A completion counts its tokens up to and including the first EOS; one that reaches
`max_completion_length` without an EOS is truncated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft_accum.training import every_rank


@dataclass
class Completion:
    """One sampled completion of prompt `prompt_index` (its `generation`-th of G)."""

    prompt_index: int
    generation: int
    prompt_ids: list[int]
    completion_ids: list[int]  # up to and including the EOS, or max_completion_length tokens
    truncated: bool


def round_seed(seed: int, round_index: int, prompt_index: int) -> int:
    """The seed of one prompt's completions in one round: distinct for every (round, prompt), fixed by `seed`."""
    return (seed * 1_000_003 + round_index * 10_007 + prompt_index) % (2**63 - 1)


@torch.no_grad()
def sample_prompt(
    accelerator,
    model,
    prompt_ids: list[int],
    *,
    seed: int,
    num_generations: int,
    max_completion_length: int,
    temperature: float,
    top_p: float,
    eos_token_id: int,
    pad_token_id: int,
) -> list[tuple[list[int], bool]]:
    """G completions of one prompt, as (token ids up to and including the EOS, truncated)."""
    input_ids = torch.tensor([prompt_ids] * num_generations, device=accelerator.device)
    with torch.random.fork_rng(devices=[accelerator.device] if accelerator.device.type == "cuda" else []):
        torch.manual_seed(seed)
        generated = every_rank.generate(
            accelerator,
            model,
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=0,
            max_new_tokens=max_completion_length,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )
    completions = []
    for row in generated[:, len(prompt_ids) :].tolist():
        ends = [i for i, token in enumerate(row) if token == eos_token_id]
        kept = row[: ends[0] + 1] if ends else row[:max_completion_length]
        completions.append((kept, not ends))
    return completions


def generate_round(
    accelerator,
    model,
    prompt_ids: list[list[int]],
    prompt_indices: list[int],
    *,
    seed: int,
    round_index: int,
    num_generations: int,
    max_completion_length: int,
    temperature: float,
    top_p: float,
    eos_token_id: int,
    pad_token_id: int,
) -> list[Completion]:
    """The round's completions, prompt by prompt in order, G each, identical on every process."""
    was_training = model.training
    model.eval()  # no dropout in sampling: the completions are the policy's, not a dropout mask's
    mine = []
    shares = every_rank.rank_batches(
        list(range(len(prompt_ids))), accelerator.process_index, accelerator.num_processes, 1
    )
    for (position,), real in shares:
        samples = sample_prompt(
            accelerator, model, prompt_ids[position], seed=round_seed(seed, round_index, prompt_indices[position]),
            num_generations=num_generations, max_completion_length=max_completion_length, temperature=temperature,
            top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )  # fmt: skip
        if real:
            mine += [Completion(prompt_indices[position], g, prompt_ids[position], ids, truncated)
                     for g, (ids, truncated) in enumerate(samples)]  # fmt: skip
    model.train(was_training)
    everyone = accelerate_gather(accelerator, mine)
    order = {index: i for i, index in enumerate(prompt_indices)}
    return sorted(everyone, key=lambda c: (order[c.prompt_index], c.generation))


def accelerate_gather(accelerator, items: list) -> list:
    """Every process's `items`, concatenated, on every process (Accelerate's gather_object)."""
    if accelerator.num_processes == 1:
        return items
    from accelerate.utils import gather_object

    return gather_object(items)


def completion_batch(completions: list[Completion], pad_token_id: int, device, mask_truncated: bool = False) -> dict:
    """A micro-batch of completions: prompts padded on the left and completions on the right, so that
    every completion starts at the same column P. `input_ids`, `attention_mask`, `position_ids`
    [B, P + C]; `completion_ids`, `completion_mask` [B, C] (1 for a token that counts: not padding,
    and not any token of a truncated completion under `mask_truncated`)."""
    prompt_width = max(len(c.prompt_ids) for c in completions)
    width = max(len(c.completion_ids) for c in completions)
    input_ids, attention, completion_ids, completion_mask = [], [], [], []
    for c in completions:
        left, right = prompt_width - len(c.prompt_ids), width - len(c.completion_ids)
        input_ids.append([pad_token_id] * left + c.prompt_ids + c.completion_ids + [pad_token_id] * right)
        attention.append([0] * left + [1] * (len(c.prompt_ids) + len(c.completion_ids)) + [0] * right)
        completion_ids.append(c.completion_ids + [pad_token_id] * right)
        counts = 0 if (mask_truncated and c.truncated) else 1
        completion_mask.append([counts] * len(c.completion_ids) + [0] * right)
    attention_mask = torch.tensor(attention, device=device)
    return {
        "input_ids": torch.tensor(input_ids, device=device),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "completion_ids": torch.tensor(completion_ids, device=device),
        "completion_mask": torch.tensor(completion_mask, device=device, dtype=torch.float32),
    }


def completion_log_probs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability [B, C], and the policy's entropy there (detached).
    Only the completion's logits are built (`logits_to_keep`): never the prompt's [B, P, V]."""
    width = batch["completion_ids"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        logits_to_keep=width + 1,
        use_cache=False,
    ).logits[:, :-1]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    token_log_probs = log_probs.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).detach()
    return token_log_probs, entropy
