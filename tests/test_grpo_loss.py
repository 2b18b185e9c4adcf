"""ft_accum/core/grpo_loss.py: the GRPO-family losses summed per micro-batch and divided by the
update's items give the full-batch loss's gradient, for every split (issue 43's equivalence, on
the formulas; the recipe's launches come with the recipe).

The policy is a bigram model (an embedding and a linear layer), so each token's log-prob has a
gradient; 8 completions of 1 to 12 counted tokens (padding after them) with old log-probs a little
off the current ones, so ratios differ from 1 and some are clipped (a reused round,
num_iterations > 1). The full-batch loss is written here from the papers' formulas, not from the
module's sums; the control, bnpo (the mean of the micro-batches' token means), must fail.
"""

import pytest
import torch

from ft_accum.core.grpo_loss import (
    LOSS_TYPES,
    clipped_surrogate,
    group_advantages,
    kl_k3,
    log_importance_weights,
    loss_sums,
)

VOCAB, LENGTH, ROWS, MAX_COMPLETION_LENGTH = 11, 12, 8, 16
EPSILON_LOW, EPSILON_HIGH, BETA = 0.2, 0.28, 0.04
# (processes, micro-batch, accumulation): 8 completions in each update.
SPLITS = [(1, 8, 1), (1, 2, 4), (1, 4, 2), (2, 2, 2)]
RTOL = 1e-5  # fp32 sums in another order agree to ~1e-7; a wrong normaliser is off by ≥ 1e-2


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (ROWS, LENGTH + 1), generator=generator)
    lengths = torch.tensor([1, 12, 3, 7, 12, 2, 9, 5])  # counted tokens: stopped early, or truncated at 12
    mask = (torch.arange(LENGTH) < lengths[:, None]).float()
    rewards = torch.rand(ROWS, generator=generator)
    old_shift = 0.3 * torch.randn(ROWS, LENGTH, generator=generator)
    reference_shift = 0.2 * torch.randn(ROWS, LENGTH, generator=generator)
    return tokens, mask, group_advantages(rewards, num_generations=4), old_shift, reference_shift


def policy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB))


def per_token_loss(model, tokens, advantages, old_shift, reference_shift, mask, level):
    logps = torch.log_softmax(model(tokens[:, :-1]), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    old, reference = logps.detach() + old_shift, logps.detach() + reference_shift
    loss, _ = clipped_surrogate(log_importance_weights(logps, old, mask, level), advantages, EPSILON_LOW, EPSILON_HIGH)
    return loss + BETA * kl_k3(logps, reference)


def full_batch_loss(loss_type, loss, mask):
    """The papers' formulas over the whole update (see the module docstring)."""
    if loss_type == "grpo":
        return ((loss * mask).sum(-1) / mask.sum(-1)).mean()
    if loss_type == "dapo":
        return (loss * mask).sum() / mask.sum()
    return (loss * mask).sum() / (len(mask) * MAX_COMPLETION_LENGTH)


def gradient(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def accumulated_gradient(loss_type, level, processes, micro, accumulation, bnpo=False):
    """What the recipe's window does: each micro-batch backpropagates its numerator over a constant,
    the processes' gradients are summed (DDP's all-reduce, without its /P), and the sync step
    multiplies by constant / the update's items. bnpo instead averages micro-batch token means."""
    tokens, mask, advantages, old, reference = batch()
    model, items, constant = policy(), 0.0, 5.0
    shards = [range(p * ROWS // processes, (p + 1) * ROWS // processes) for p in range(processes)]
    micro_batches = [list(shard)[i : i + micro] for shard in shards for i in range(0, len(shard), micro)]
    assert len(micro_batches) == processes * accumulation
    for rows in micro_batches:
        loss = per_token_loss(model, tokens[rows], advantages[rows], old[rows], reference[rows], mask[rows], level)
        if bnpo:
            ((loss * mask[rows]).sum() / mask[rows].sum() / len(micro_batches)).backward()
            continue
        numerator, counted = loss_sums(loss_type, loss, mask[rows], MAX_COMPLETION_LENGTH)
        (numerator / constant).backward()
        items += float(counted)
    return gradient(model) if bnpo else gradient(model) * constant / items


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_split_gives_the_full_batch_gradient(loss_type, level):
    tokens, mask, advantages, old, reference = batch()
    model = policy()
    full_batch_loss(loss_type, per_token_loss(model, tokens, advantages, old, reference, mask, level), mask).backward()
    full = gradient(model)
    for split in SPLITS:
        ours = accumulated_gradient(loss_type, level, *split)
        error = float((ours - full).norm() / full.norm())
        assert error <= RTOL, (split, error)


def test_the_control_bnpo_is_off_the_token_mean_once_split():
    tokens, mask, advantages, old, reference = batch()
    model = policy()
    full_batch_loss("dapo", per_token_loss(model, tokens, advantages, old, reference, mask, "token"), mask).backward()
    full = gradient(model)
    assert float((accumulated_gradient("dapo", "token", 1, 8, 1, bnpo=True) - full).norm() / full.norm()) <= RTOL
    error = float((accumulated_gradient("dapo", "token", 1, 2, 4, bnpo=True) - full).norm() / full.norm())
    assert error > 1e-2, error


def test_group_advantages_and_the_clip():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    scaled = group_advantages(rewards, 4)
    assert torch.allclose(scaled[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (0.5773503 + 1e-4))
    assert torch.equal(scaled[4:], torch.zeros(4))  # a group of equal rewards teaches nothing
    assert torch.equal(group_advantages(rewards, 4, scale_rewards=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(rewards[:7], 4)
    # r = 2 with Â > 0 is clipped at 1 + ε_high; r = 0.5 with Â < 0 at 1 − ε_low
    loss, clipped = clipped_surrogate(torch.log(torch.tensor([[2.0, 0.5]])), torch.tensor([1.0]), 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor([[-1.28, -0.5]])) and clipped.tolist() == [[True, False]]
    loss, clipped = clipped_surrogate(torch.log(torch.tensor([[2.0, 0.5]])), torch.tensor([-1.0]), 0.2, 0.28)
    assert torch.allclose(loss, torch.tensor([[2.0, 0.8]])) and clipped.tolist() == [[False, True]]
    assert (
        float(kl_k3(torch.tensor(0.3), torch.tensor(0.3))) == 0.0
        and float(kl_k3(torch.tensor(0.0), torch.tensor(1.0))) > 0
    )
