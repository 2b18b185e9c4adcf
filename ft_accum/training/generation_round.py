"""The generation round of online RL (issue 43): G sampled completions per prompt, the same whatever
the micro-batch, the accumulation or the number of processes.

The round's prompts are cut, in round order, into groups of `Sampling.prompts_per_call`; each
group's G completions per prompt come from one `generate()` call (prompts padded on the left),
seeded by (seed, round, the group's first prompt index) inside `torch.random.fork_rng`. So they
depend on the round's prompts, the seed and the group size only: not on which process generates a
group, nor on the micro-batch or the accumulation, and the training RNG stream is left as it was.
One call per group instead of per prompt: decoding is a loop of small steps, and a step over more
rows costs less than several steps (2.7× faster a round on a 2-core CPU at 8 prompts a call,
benchmarks/README.md, GRPO generation; not measured on a GPU). On several processes
each generates its share of the groups (`every_rank.rank_batches`: the same number of calls on
every rank, as FSDP needs), and the round is gathered, in prompt order, on every process.

A completion counts its tokens up to and including the first EOS; one that reaches
`max_completion_length` without an EOS is truncated.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather_object

from ft_accum.core.errors import ConfigError
from ft_accum.models.output_loss import token_log_probs
from ft_accum.training import every_rank
from ft_accum.training.windows import Window


@dataclass
class Completion:
    """One sampled completion of prompt `prompt_index` (its `generation`-th of G)."""

    prompt_index: int
    generation: int
    prompt_ids: list[int]
    completion_ids: list[int]  # up to and including the EOS, or max_completion_length tokens
    truncated: bool


@dataclass(frozen=True)
class Sampling:
    """How a round samples: G completions per prompt, each at most `max_completion_length` tokens."""

    num_generations: int
    max_completion_length: int
    temperature: float
    top_p: float
    eos_token_id: int
    pad_token_id: int
    prompts_per_call: int = 1  # prompts sampled together in one generate() call (each G times)


def round_seed(seed: int, round_index: int, prompt_index: int) -> int:
    """The seed of one group's completions in one round, by its first prompt: distinct for every
    (round, prompt), fixed by `seed`."""
    return (seed * 1_000_003 + round_index * 10_007 + prompt_index) % (2**63 - 1)


@torch.no_grad()
def sample_prompts(
    accelerator, model, prompts: list[list[int]], sampling: Sampling, seed: int
) -> list[list[tuple[list[int], bool]]]:
    """G completions of each of `prompts`, sampled in one call, as (token ids up to and including the
    EOS, truncated), G per prompt. The prompts are padded on the left, so every row's completion
    starts at the same column."""
    width, g = max(len(ids) for ids in prompts), sampling.num_generations
    rows = [[sampling.pad_token_id] * (width - len(ids)) + ids for ids in prompts for _ in range(g)]
    masks = [[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts for _ in range(g)]
    with torch.random.fork_rng(devices=[accelerator.device] if accelerator.device.type == "cuda" else []):
        torch.manual_seed(seed)
        generated = every_rank.generate(
            accelerator,
            model,
            input_ids=torch.tensor(rows, device=accelerator.device),
            attention_mask=torch.tensor(masks, device=accelerator.device),
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            max_new_tokens=sampling.max_completion_length,
            eos_token_id=sampling.eos_token_id,
            pad_token_id=sampling.pad_token_id,
        )
    completions = []
    for row in generated[:, width:].tolist():
        ends = [i for i, token in enumerate(row) if token == sampling.eos_token_id]
        kept = row[: ends[0] + 1] if ends else row[: sampling.max_completion_length]
        completions.append((kept, not ends))
    return [completions[i * g : (i + 1) * g] for i in range(len(prompts))]


def generate_round(
    accelerator,
    model,
    prompt_ids: list[list[int]],
    prompt_indices: list[int],
    sampling: Sampling,
    *,
    seed: int,
    round_index: int,
) -> list[Completion]:
    """The round's completions, in prompt order, G each, identical on every process."""
    was_training = model.training
    model.eval()  # no dropout in sampling: the completions are the policy's, not a dropout mask's
    mine = []
    size = sampling.prompts_per_call
    groups = [list(range(start, min(start + size, len(prompt_ids)))) for start in range(0, len(prompt_ids), size)]
    for (group,), real in every_rank.rank_batches(groups, accelerator.process_index, accelerator.num_processes, 1):
        first = prompt_indices[group[0]]
        samples = sample_prompts(
            accelerator, model, [prompt_ids[p] for p in group], sampling, round_seed(seed, round_index, first)
        )
        if real:
            mine += [
                Completion(prompt_indices[p], g, prompt_ids[p], ids, truncated)
                for p, completions in zip(group, samples)
                for g, (ids, truncated) in enumerate(completions)
            ]
    model.train(was_training)
    order = {index: i for i, index in enumerate(prompt_indices)}
    return sorted(gather_object(mine), key=lambda c: (order[c.prompt_index], c.generation))


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


@dataclass(frozen=True)
class RoundLayout:
    """How a round is cut. It holds `completions` = prompts × G (all processes), for `updates`
    updates of E = micro × accumulation × processes completions each, each pass of
    `iterations`; update u trains on completions [u·E, (u+1)·E), of which process p takes
    micro × accumulation from offset p · micro · accumulation: micro-batches
    k = (u·E + p·micro·accumulation) / micro + m, m < accumulation (`own[u]`)."""

    completions: int
    prompts: int
    updates: int
    iterations: int
    rounds_per_epoch: int
    micro: int
    own: list[list[int]]

    @property
    def passes(self) -> int:
        """Updates made from one round."""
        return self.updates * self.iterations


def round_layout(
    plan,
    generation_batch_size: int | None,
    num_generations: int,
    num_iterations: int,
    num_prompts: int,
    process_index: int,
) -> RoundLayout:
    """The RoundLayout of `generation_batch_size` completions a round (default: one update's), or a
    ConfigError that names the fix."""
    completions = generation_batch_size or plan.effective
    if completions % num_generations or completions % plan.effective:
        raise ConfigError(
            f"--generation_batch_size {completions} must be a multiple of --num_generations {num_generations} "
            f"and of the effective batch {plan.effective}; use {plan.effective * num_generations}"
        )
    prompts, updates = completions // num_generations, completions // plan.effective
    if num_prompts < prompts:
        raise ConfigError(f"{num_prompts} training prompts are fewer than one round's {prompts}")
    share = plan.micro * plan.accumulation
    own = [
        [(u * plan.effective + process_index * share) // plan.micro + m for m in range(plan.accumulation)]
        for u in range(updates)
    ]
    return RoundLayout(completions, prompts, updates, num_iterations, num_prompts // prompts, plan.micro, own)


def micro_batches(
    completions: list[Completion], layout: RoundLayout, pad_token_id: int, device, mask_truncated: bool = False
) -> dict[int, dict]:
    """{k: `completion_batch` of completions [k·micro, (k+1)·micro)} for this process's micro-batches
    (`layout.own`): a process builds only the ones it trains on."""
    micro = layout.micro
    return {
        k: completion_batch(completions[k * micro : (k + 1) * micro], pad_token_id, device, mask_truncated)
        for update in layout.own
        for k in update
    }


def completion_log_probs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability [B, C], and the policy's entropy there (detached).
    Only the completion's logits are built (`logits_to_keep`): never the prompt's [B, P, V]; and
    their fp32 log-softmax only a chunk at a time (`output_loss.token_log_probs`)."""
    width = batch["completion_ids"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        logits_to_keep=width + 1,
        use_cache=False,
    ).logits  # position t predicts completion token t; the last one predicts past the completion
    return token_log_probs(logits, batch["completion_ids"])


def update_metrics(accelerator, window, logs, functions) -> dict:
    """metrics.jsonl's GRPO columns for the update `window` (of `RoundWindows`), which trained on its
    round's completions `window.rows`: their rewards (weighted, and each function's), lengths and
    truncation, and the token means of clipping, entropy and KL, `logs` = [clipped, entropy, KL,
    counted tokens] summed on this process, over all processes."""
    rewards, scores, rows = window.round.rewards, window.round.per_function, window.rows
    completions = window.round.completions
    clipped, entropy, kl, tokens = accelerator.reduce(logs, reduction="sum").tolist()
    update, mine = rewards[rows], completions[rows]
    lengths = [len(c.completion_ids) for c in mine]
    columns = {
        "reward": float(update.mean()),
        "reward_std": float(update.std()) if len(update) > 1 else 0.0,
        "completion_length": sum(lengths) / len(lengths),
        "completion_length_max": max(lengths),
        "truncated_fraction": sum(c.truncated for c in mine) / len(mine),
        "clip_fraction": clipped / max(tokens, 1),
        "entropy": entropy / max(tokens, 1),
        "kl": kl / max(tokens, 1),
    }
    for (name, _), function_scores in zip(functions, scores):
        columns[f"reward/{name.split(':')[-1]}"] = sum(function_scores[rows]) / len(function_scores[rows])
    return columns


@dataclass
class SampledRound:
    """What the recipe's sampling returns for a round: its completions, their weighted rewards and each
    function's, and this process's micro-batches ({k: batch}, `RoundLayout.own`)."""

    completions: list[Completion]
    rewards: torch.Tensor
    per_function: list
    batches: dict[int, dict]


class RoundWindows:
    """The run's remaining GRPO updates as windows (training/windows.py), round after round.

    Each round samples its prompts (in an order fixed by the seed and epoch) through the recipe's
    `sample(indices, round_index) -> SampledRound`; then each of its `layout.passes` updates is one
    Window of this process's micro-batches, counted (`count_items`) on all processes before its
    first forward. `window.round` is the sampled round, `window.rows` the slice of its completions
    the update trains on (for the metrics). A resume re-enters at the round of its last update.
    """

    def __init__(
        self,
        accelerator,
        state,
        plan,
        layout: RoundLayout,
        *,
        update_plan,
        num_prompts: int,
        seed: int,
        sample: Callable[..., SampledRound],
        count_items: Callable[[Any], Any],
    ):
        self.accelerator, self.state, self.plan, self.layout = accelerator, state, plan, layout
        self.update_plan, self.num_prompts, self.seed = update_plan, num_prompts, seed
        self.sample, self.count_items = sample, count_items

    def __iter__(self) -> Iterator[Window]:
        state, layout, plan = self.state, self.layout, self.plan
        per_round = layout.passes * layout.micro * plan.accumulation  # this process's samples a round
        batches_per_epoch = layout.rounds_per_epoch * layout.passes * plan.accumulation
        while state.epoch < self.update_plan.num_epochs and state.scheduler_steps < self.update_plan.num_update_steps:
            order = random.Random(self.seed * 1000 + state.epoch).sample(range(self.num_prompts), self.num_prompts)
            for round_index in range(state.epoch_samples // per_round, layout.rounds_per_epoch):
                indices = order[round_index * layout.prompts : (round_index + 1) * layout.prompts]
                sampled = self.sample(indices, round_index=state.epoch * layout.rounds_per_epoch + round_index)
                for update in range(layout.passes):
                    u = update % layout.updates  # the update trains on completions [u·E, (u+1)·E)
                    window = Window(
                        self.accelerator,
                        [sampled.batches[k] for k in layout.own[u]],
                        count_items=self.count_items,
                        plan=plan,
                        update=state.step,
                        last_checkpoint=state.last_checkpoint,
                        epoch=state.epoch,
                        epoch_samples=state.epoch_samples + plan.micro * len(layout.own[u]),
                        epoch_size=plan.micro * batches_per_epoch,
                        count_tokens=lambda batch: batch["completion_mask"].sum(),  # the completions' tokens
                    )
                    window.round, window.rows = sampled, slice(u * plan.effective, (u + 1) * plan.effective)
                    last_of_epoch = round_index == layout.rounds_per_epoch - 1 and update == layout.passes - 1
                    window.ends_epoch = last_of_epoch or state.scheduler_steps + 1 >= self.update_plan.num_update_steps
                    yield window
                    if state.scheduler_steps >= self.update_plan.num_update_steps:
                        return
            state.next_epoch()
