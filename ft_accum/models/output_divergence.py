"""A distillation loss between two language models' output layers, without either model's full logits.

At [B, T, V] logits the fp32 log-softmaxes of student and teacher are the largest tensors of a
distillation step (at 8 × 512 tokens of SmolLM2's 49,152 entries, 0.8 GB each, and the student's
again for its gradient). `linear_distillation_sum` computes Σ_t ℓ(z_s,t, z_t,t, y_t) over the target
positions (ℓ: core/distillation_loss.distillation_token_losses, or any per-position loss of the two
logits) a chunk of positions at a time: each chunk's student and teacher logits are computed from the
output layers' inputs, its loss and d ℓ / d z_s by autograd on the chunk alone, and the gradients with
respect to the student's hidden states and output layer accumulated in the forward pass (as
models/output_loss.py's chunked cross-entropy does), so no chunk outlives its iteration.

The hidden states come from `OutputLoss.hidden_states` (the model's own forward, its output layer
handed a zero-length slice). Where that path is not exact (FSDP, a wrapped output layer, a model that
changes its logits after the layer) the recipe falls back to `full_logits_distillation_sum`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ft_accum.core.distillation_loss import at_least_fp32
from ft_accum.models.output_loss import LOGITS_PER_CHUNK, OutputLoss, gradients_formed_in_forward, shift_labels

# ℓ holds about ten [chunk, V] fp32 tensors at once (both models' logits, their log-softmaxes and
# probabilities, the mixture's, the gradient), where cross-entropy holds about three: an eighth of
# OutputLoss's chunk keeps the peak below the cross-entropy's (16 MiB of logits: 85 positions of a
# 49k vocabulary per matmul, still a full-width GEMM).
DISTILLATION_LOGITS_PER_CHUNK = LOGITS_PER_CHUNK // 8
TokenLosses = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (z_s, z_t, y) [N, V] → [N]


class _LinearDistillationSum(torch.autograd.Function):
    """Σ ℓ(h Wᵀ + b, teacher logits, y) over the given positions, its gradients with respect to h, W, b computed
    per chunk in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_layer, targets, token_losses, chunk_size, grad_enabled):  # fmt: skip
        needs_grad = ctx.needs_input_grad[:3] if grad_enabled else (False, False, False)
        device_type = hidden.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        teacher_dtype = teacher_layer.weight.dtype
        with torch.autocast(device_type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            loss = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
            grad_h = torch.zeros_like(hidden) if needs_grad[0] else None
            grad_w = (
                torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
                if needs_grad[1]
                else None
            )
            grad_b = (
                torch.zeros_like(bias, dtype=torch.promote_types(bias.dtype, torch.float32)) if needs_grad[2] else None
            )
            for start in range(0, len(h), chunk_size):
                end = start + chunk_size
                h_chunk = h[start:end]
                teacher_logits = at_least_fp32(teacher_layer(teacher_hidden[start:end].to(teacher_dtype)))
                student_logits = at_least_fp32(F.linear(h_chunk, w, b))
                if not any(needs_grad):
                    loss += token_losses(student_logits, teacher_logits, targets[start:end]).sum()
                    continue
                with torch.enable_grad():
                    logits = student_logits.requires_grad_()
                    chunk_loss = token_losses(logits, teacher_logits, targets[start:end]).sum()
                    (grad_logits,) = torch.autograd.grad(chunk_loss, logits)
                loss += chunk_loss.detach()
                if grad_b is not None:
                    grad_b += grad_logits.sum(0)
                grad_logits = grad_logits.to(dtype)
                if grad_h is not None:
                    grad_h[start:end] = grad_logits @ w
                if grad_w is not None:  # accumulated in fp32 whatever the compute dtype
                    grad_w += grad_logits.t() @ h_chunk
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return (*gradients_formed_in_forward(ctx, grad_loss), *(None,) * 6)


def linear_distillation_sum(
    hidden: torch.Tensor,
    output_layer: torch.nn.Linear,
    teacher_hidden: torch.Tensor,
    teacher_layer: torch.nn.Module,
    targets: torch.Tensor,
    token_losses: TokenLosses,
    ignore_index: int = -100,
    logits_per_chunk: int = DISTILLATION_LOGITS_PER_CHUNK,
    trim_to_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_t ℓ(z_s,t, z_t,t, y_t) over targets ≠ ignore_index, their count), no full logits of either model.

    `hidden` [..., H] and `teacher_hidden` [..., H_t] are the two output layers' inputs at the same
    positions, `targets` [...] the aligned next tokens (`output_loss.shift_labels`). Equal to
    `full_logits_distillation_sum` on the layers' logits up to summation order (tests/test_distillation_loss.py).
    """
    flat_targets = targets.reshape(-1)
    index = counted_positions(flat_targets, ignore_index, trim_to_targets)
    loss = _LinearDistillationSum.apply(
        hidden.reshape(-1, hidden.shape[-1])[index],
        output_layer.weight,
        output_layer.bias,
        teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach()[index],
        teacher_layer,
        flat_targets[index],
        token_losses,
        max(1, logits_per_chunk // output_layer.weight.shape[0]),
        torch.is_grad_enabled(),
    )
    return loss, index.new_tensor(len(index))


def counted_positions(flat_targets: torch.Tensor, ignore_index: int = -100, trim: bool = True) -> torch.Tensor:
    """The positions whose target counts (one host read per micro-batch): ℓ costs several passes over the
    vocabulary per position, and most of a chat's positions are its prompt. `trim=False` takes every
    position, for the planner's fake tensors (which cannot size `nonzero`): its targets all count."""
    if not trim:
        return torch.arange(flat_targets.numel(), device=flat_targets.device)
    return (flat_targets != ignore_index).nonzero().squeeze(1)


def full_logits_distillation_sum(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    token_losses: TokenLosses,
    trim_to_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same sum from both models' full logits [..., V] (the reference, and the path under FSDP), at the
    target positions only."""
    flat_targets = targets.reshape(-1)
    index = counted_positions(flat_targets, trim=trim_to_targets)
    losses = token_losses(
        at_least_fp32(logits.reshape(-1, logits.shape[-1])[index]),
        at_least_fp32(teacher_logits.reshape(-1, teacher_logits.shape[-1])[index]),
        flat_targets[index],
    )
    return losses.sum(), index.new_tensor(len(index))


class DistillationLoss:
    """A micro-batch's summed distillation loss between the trained `model` and the frozen `teacher`.

    `loss_fn = DistillationLoss(accelerator.unwrap_model(model), teacher, token_losses=..., accelerator=...)`
    once, then `loss_sum, num_tokens = loss_fn(model, teacher, labels, **inputs)`: both models read
    the same causal-LM inputs, position t predicting token t + 1, and only the labelled (assistant)
    positions count. Chunked through both output layers (`linear_distillation_sum`) where `OutputLoss`
    says the hidden-state path is exact for each model, else from the full logits; `path` says which.
    """

    def __init__(
        self,
        unwrapped_model,
        teacher,
        *,
        token_losses: TokenLosses,
        accelerator=None,
        enabled: bool = True,
        check_logits: bool = True,
        trim_to_targets: bool = True,
    ):
        # check_logits and trim_to_targets off: the planner's trace (fake tensors have no values; see OutputLoss).
        self.student = OutputLoss(
            unwrapped_model, shift=True, accelerator=accelerator, enabled=enabled, check_logits=check_logits
        )
        self.teacher = OutputLoss(teacher, shift=True, enabled=enabled, check_logits=check_logits)
        self.token_losses, self.trim_to_targets = token_losses, trim_to_targets

    @property
    def path(self) -> str:
        return self.student.path if not self.student.chunked else self.teacher.path

    def __call__(self, model, teacher, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        for side, module in ((self.student, model), (self.teacher, teacher)):
            if not side.checked:  # once: the hidden-state path gives this model's logits, or it falls back
                side.check_against_logits(module, labels, inputs)
        targets = shift_labels(labels)
        if not (self.student.chunked and self.teacher.chunked):
            with torch.no_grad():
                teacher_logits = teacher(**inputs).logits
            return full_logits_distillation_sum(
                model(**inputs).logits, teacher_logits, targets, self.token_losses, self.trim_to_targets
            )
        with torch.no_grad():
            teacher_hidden = self.teacher.hidden_states(teacher, **inputs)
        hidden = self.student.hidden_states(model, **inputs)
        return linear_distillation_sum(
            hidden,
            self.student.layer,
            teacher_hidden,
            self.teacher.layer,
            targets,
            self.token_losses,
            trim_to_targets=self.trim_to_targets,
        )
