"""ft_accum/training/generation_round.py: a round's completions depend on the prompts, the seed and
how many prompts one call samples only (issue 43: generation does not depend on the split), and
leave the training RNG as it was.
On a tiny Llama with SmolLM2's tokenizer, in this process; the 2-process round is the recipe's."""

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from ft_accum.data.chat_data import render_ids
from ft_accum.training.generation_round import Sampling, generate_round, round_layout
from ft_accum.training.run_setup import reset_accelerate_state


@pytest.fixture
def setup(chat_lm_dir):
    accelerator = Accelerator(cpu=True)
    tokenizer = AutoTokenizer.from_pretrained(chat_lm_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_lm_dir)
    # of different lengths: a call of several prompts pads them on the left
    prompts = [render_ids(tokenizer, [{"role": "user", "content": f"What is {i} + {17 ** (3 * i)}?"}],
                          add_generation_prompt=True) for i in range(5)]  # fmt: skip
    assert len({len(ids) for ids in prompts}) > 2
    model.train()  # as in the training loop: the round samples in eval mode, then puts it back
    yield accelerator, model, tokenizer, prompts
    reset_accelerate_state()


def round_of(accelerator, model, tokenizer, prompts, indices, eos=None, length=6, per_call=1, temperature=1.0):
    eos = tokenizer.eos_token_id if eos is None else eos
    sampling = Sampling(num_generations=4, max_completion_length=length, temperature=temperature, top_p=1.0,
                        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, prompts_per_call=per_call)  # fmt: skip
    return generate_round(accelerator, model, [prompts[i] for i in indices], indices, sampling, seed=3, round_index=1)


def by_prompt(completions):
    return {(c.prompt_index, c.generation): c.completion_ids for c in completions}


def test_a_prompts_completions_do_not_depend_on_the_other_prompts_or_their_order(setup):
    accelerator, model, tokenizer, prompts = setup
    everything = round_of(accelerator, model, tokenizer, prompts, [0, 1, 2, 3, 4])
    assert [(c.prompt_index, c.generation) for c in everything] == [(p, g) for p in range(5) for g in range(4)]
    shuffled = round_of(accelerator, model, tokenizer, prompts, [3, 0, 4])
    alone = round_of(accelerator, model, tokenizer, prompts, [2])
    assert by_prompt(shuffled) == {k: v for k, v in by_prompt(everything).items() if k[0] in (0, 3, 4)}
    assert by_prompt(alone) == {k: v for k, v in by_prompt(everything).items() if k[0] == 2}
    assert len({tuple(c.completion_ids) for c in everything}) > 10  # sampled, not one greedy answer repeated
    assert all(c.truncated and len(c.completion_ids) == 6 for c in everything)  # no EOS drawn in 6 tokens


def test_prompts_sampled_in_one_call_depend_on_their_group_only(setup):
    """At 2 prompts a call, the round [0, 1, 2, 3, 4] samples {0, 1}, {2, 3}, {4}: each group's
    completions are those of the group sampled alone (seeded by its first prompt), whatever else the
    round holds; a group of one is the prompt-by-prompt sampling; and grouping changes the draw."""
    accelerator, model, tokenizer, prompts = setup
    grouped = by_prompt(round_of(accelerator, model, tokenizer, prompts, [0, 1, 2, 3, 4], per_call=2))
    assert sorted(grouped) == [(p, g) for p in range(5) for g in range(4)]
    assert by_prompt(round_of(accelerator, model, tokenizer, prompts, [2, 3], per_call=2)) == {
        k: v for k, v in grouped.items() if k[0] in (2, 3)
    }
    assert by_prompt(round_of(accelerator, model, tokenizer, prompts, [4])) == {
        k: v for k, v in grouped.items() if k[0] == 4
    }
    alone = by_prompt(round_of(accelerator, model, tokenizer, prompts, [1]))
    assert alone != {k: v for k, v in grouped.items() if k[0] == 1}  # its group's draw, not its own
    # Near-greedy, with logits far apart (this random model's are within 0.01 of each other), the draw
    # does not matter: a prompt padded on the left in a group of 5 continues as it does alone.
    with torch.no_grad():
        model.lm_head.weight *= 1e4
    cold = {"temperature": 1e-3}
    together = by_prompt(round_of(accelerator, model, tokenizer, prompts, [0, 1, 2, 3, 4], per_call=5, **cold))
    for p in range(5):
        assert by_prompt(round_of(accelerator, model, tokenizer, prompts, [p], **cold)) == {
            k: v for k, v in together.items() if k[0] == p
        }


def test_a_completion_ends_at_its_eos_and_the_training_rng_is_untouched(setup):
    accelerator, model, tokenizer, prompts = setup
    first = round_of(accelerator, model, tokenizer, prompts, [0])[0].completion_ids
    eos = first[2]  # a token this completion draws: as EOS, it ends the completion there
    torch.manual_seed(11)
    ended = round_of(accelerator, model, tokenizer, prompts, [0], eos=eos)[0]
    after_round = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(after_round, torch.rand(3))
    stop = first.index(eos)
    assert ended.completion_ids == first[: stop + 1] and not ended.truncated
    assert model.training  # put back in training mode


@pytest.mark.parametrize(
    "processes, micro, accumulation, updates", [(1, 8, 1, 1), (1, 2, 4, 2), (2, 2, 2, 3), (4, 1, 2, 2)]
)
def test_each_micro_batch_of_a_round_is_one_processs_in_one_update(processes, micro, accumulation, updates):
    """RoundLayout.own: over the processes, update u's micro-batches are exactly those of completions
    [u·E, (u+1)·E)."""
    from ft_accum.core.batch_arithmetic import BatchPlan

    plan = BatchPlan(micro=micro, accumulation=accumulation, processes=processes)
    layouts = [round_layout(plan, plan.effective * updates, 2, 1, 100, p) for p in range(processes)]
    for u in range(updates):
        ks = sorted(k for layout in layouts for k in layout.own[u])
        assert ks == list(range(u * plan.effective // micro, (u + 1) * plan.effective // micro))
    assert (
        layouts[0].prompts == plan.effective * updates // 2
        and layouts[0].rounds_per_epoch == 100 // layouts[0].prompts
    )
