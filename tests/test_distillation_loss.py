"""The distillation losses (core/distillation_loss.py) against their definitions, and the chunked sum
through both output layers (models/output_divergence.py) against the full logits, in float64."""

import functools

import pytest
import torch
import torch.nn.functional as F

from ft_accum.core.distillation_loss import check_distillation_settings, distillation_token_losses, token_divergences
from ft_accum.core.errors import ConfigError
from ft_accum.models.output_divergence import full_logits_distillation_sum, linear_distillation_sum


def gkd_reference(student_logits, teacher_logits, beta, temperature):
    """GKD's eq. 1 as TRL 1.x writes it with F.kl_div (whose target is the first argument of the KL),
    the limits β = 0 and 1 as its forward and reverse KL."""
    log_q = F.log_softmax(student_logits / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    mixture = torch.log(beta * log_p.exp() + (1 - beta) * log_q.exp())
    kl_teacher = F.kl_div(mixture, log_p, reduction="none", log_target=True).sum(-1)
    kl_student = F.kl_div(mixture, log_q, reduction="none", log_target=True).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_divergences_are_gkd_s_definitions(beta, temperature):
    generator = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 12, 30, generator=generator, dtype=torch.float64)
    ours = token_divergences(student, teacher, beta=beta, temperature=temperature).double()
    torch.testing.assert_close(ours, gkd_reference(student, teacher, beta, temperature), rtol=1e-5, atol=1e-6)
    assert (ours >= -1e-6).all()  # divergences
    # The same distribution: no divergence; the forward KL is not the reverse one.
    assert token_divergences(teacher, teacher, beta=beta).abs().max() <= 1e-5
    if beta == 0:
        assert not torch.allclose(
            ours, token_divergences(student, teacher, beta=1.0, temperature=temperature).double()
        )


def test_alpha_mixes_in_the_cross_entropy_and_tau_squared_scales_the_divergence():
    generator = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 9, 20, generator=generator)
    targets = torch.randint(0, 20, (9,), generator=generator)
    divergence = token_divergences(student, teacher, beta=0.5, temperature=2.0)
    ce = F.cross_entropy(student, targets, reduction="none")
    losses = distillation_token_losses(student, teacher, targets, beta=0.5, temperature=2.0, alpha=0.25)
    torch.testing.assert_close(losses, 0.75 * 4 * divergence + 0.25 * ce)
    only_ce = distillation_token_losses(student, teacher, targets, beta=0.5, temperature=2.0, alpha=1.0)
    torch.testing.assert_close(only_ce, ce)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"beta": 1.5, "temperature": 1.0, "alpha": 0.0}, "--beta must be in [0, 1]"),
        ({"beta": 0.5, "temperature": 0.0, "alpha": 0.0}, "--temperature must be > 0"),
        ({"beta": 0.5, "temperature": 1.0, "alpha": -0.1}, "--alpha must be in [0, 1]"),
    ],
)
def test_settings_out_of_range_are_one_line(settings, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_distillation_settings(**settings)


@pytest.mark.parametrize(
    "beta, alpha, temperature", [(0.0, 0.0, 1.0), (0.5, 0.0, 2.0), (1.0, 0.0, 1.0), (0.5, 0.5, 1.0)]
)
def test_the_chunked_sum_equals_the_full_logits_in_value_and_gradients(beta, alpha, temperature):
    """Float64, 2 × 19 positions of a 50-token vocabulary, some ignored, in chunks of 3 positions."""
    torch.manual_seed(2)
    student_layer = torch.nn.Linear(8, 50, dtype=torch.float64)
    teacher_layer = torch.nn.Linear(12, 50, bias=False, dtype=torch.float64).requires_grad_(False)
    hidden = torch.randn(2, 19, 8, dtype=torch.float64, requires_grad=True)
    teacher_hidden = torch.randn(2, 19, 12, dtype=torch.float64)
    targets = torch.randint(0, 50, (2, 19))
    targets[0, :5] = targets[1, 15:] = -100  # a prompt, and padding
    token_losses = functools.partial(distillation_token_losses, beta=beta, temperature=temperature, alpha=alpha)

    def gradients(loss):
        student_layer.zero_grad()
        hidden.grad = None
        loss.backward()
        return [hidden.grad, student_layer.weight.grad, student_layer.bias.grad]

    chunked, count = linear_distillation_sum(
        hidden, student_layer, teacher_hidden, teacher_layer, targets, token_losses, logits_per_chunk=150
    )
    chunked_grads = gradients(chunked)
    full, full_count = full_logits_distillation_sum(
        student_layer(hidden), teacher_layer(teacher_hidden), targets, token_losses
    )
    full_grads = gradients(full)
    assert int(count) == int(full_count) == 2 * 19 - 9
    torch.testing.assert_close(chunked.double(), full.double(), rtol=1e-6, atol=1e-9)
    for ours, reference in zip(chunked_grads, full_grads):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-9)
    with torch.no_grad():  # evaluation: the same value, no gradient kept
        value, _ = linear_distillation_sum(hidden, student_layer, teacher_hidden, teacher_layer, targets, token_losses)
    assert not value.requires_grad and float(value) == pytest.approx(float(full.detach()), rel=1e-6)


def test_which_sequences_the_student_samples_does_not_depend_on_the_split():
    from ft_accum.core.distillation_loss import student_samples

    ids = list(range(64))
    whole = student_samples(7, 3, ids, 0.5)
    in_micro_batches = [d for start in range(0, 64, 6) for d in student_samples(7, 3, ids[start : start + 6], 0.5)]
    assert in_micro_batches == whole
    assert 20 <= sum(whole) <= 44  # a fraction near λ (binomial(64, 0.5): 99.9% within these bounds)
    assert student_samples(7, 4, ids, 0.5) != whole  # a new draw each update
    assert not any(student_samples(7, 3, ids, 0.0)) and all(student_samples(7, 3, ids, 1.0))
