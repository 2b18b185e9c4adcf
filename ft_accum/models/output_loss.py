"""The summed cross-entropy of a language model's output layer, without ever materialising its logits.

A causal LM's logits are (batch × length × vocabulary): at 8 × 1024 tokens and Qwen's 151,936
entries that is 2.5 GB in bf16, plus the fp32 copy that a stable log-softmax wants (5 GB) and its
gradient (5 GB), which is more than the rest of a small model's step on a 12 GB card (issue 16).

`linear_cross_entropy_sum` computes Σ_t CE(h_t Wᵀ + b, y_t) over the target tokens only, in chunks
of ~32M logits, and computes each chunk's gradients with respect to h and W in the forward pass
(d CE / d logits = softmax − onehot), so no chunk outlives its loop iteration. This is Liger
Kernel's fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989) in plain PyTorch; Apple's
cut-cross-entropy (Wijmans et al. 2024, arXiv:2411.09009) and torchtune's chunked output loss make
the same trade. Cost: the gradient of W (fp32, the size of the output layer) and of h are held from
the forward to the backward; FLOPs are those of the unchunked loss.

`OutputLoss` gets h from the model's own forward: a pre-hook on the output layer keeps its input
and hands the layer a zero-length slice, so the model runs unchanged (DDP hooks included) but
computes no logits. The hook sees exactly what the layer would have (T5's d_model^-0.5 scaling
included); anything a model does *after* its output layer (Gemma-2's soft-capping, Cohere's
logit_scale, BART's final_logits_bias) is caught by a one-off check against the real logits, and
that model, like FSDP and DeepSpeed (whose weights are sharded outside the forward), a LoRA- or
4-bit-wrapped output layer, and `--no_chunked_loss`, takes the unchunked path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft_accum.core.loss_normalization import causal_lm_loss_sum

LOGITS_PER_CHUNK = 1 << 25  # 128 MiB of fp32 logits per chunk: big enough for fast matmuls, small beside a step


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """labels[:, 1:] padded with ignore_index: position t predicts token t+1 (see causal_lm_loss_sum)."""
    return F.pad(labels, (0, 1), value=ignore_index)[:, 1:]


def gradients_formed_in_forward(ctx, grad_loss: torch.Tensor) -> tuple:
    """The backward of a loss whose gradients with respect to (hidden, weight, bias) its forward formed and
    kept in `ctx.grads` (weight and bias in fp32; their dtypes in `ctx.dtypes`): each times the incoming one."""
    grad_h, grad_w, grad_b = ctx.grads
    del ctx.grads
    w_dtype, b_dtype = ctx.dtypes
    return (
        grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None,
        (grad_w * grad_loss).to(w_dtype) if grad_w is not None else None,
        (grad_b * grad_loss).to(b_dtype) if grad_b is not None else None,
    )


class _LinearCrossEntropySum(torch.autograd.Function):
    """Σ CE(hidden Wᵀ + bias, targets), its gradients computed chunk by chunk in the forward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, is_target, chunk_size, grad_enabled, label_smoothing):
        # forward runs with grad mode off, and needs_input_grad ignores the caller's torch.no_grad():
        # without `grad_enabled` (the caller's mode) an evaluation or a DPO reference pass would
        # compute both gradients, and hold an fp32 copy of the output layer, for nothing.
        needs_grad = ctx.needs_input_grad[:3] if grad_enabled else (False, False, False)
        device_type = hidden.device.type
        # The dtype the output layer would run in: autocast's, or the weights' own.
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        with torch.autocast(device_type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(hidden) if needs_grad[0] else None
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if needs_grad[1] else None
            grad_b = torch.zeros_like(bias, dtype=torch.float32) if needs_grad[2] else None
            for start in range(0, len(h), chunk_size):
                end = start + chunk_size
                h_chunk, y, keep = h[start:end], targets[start:end], is_target[start:end].float()
                log_probs = torch.log_softmax(F.linear(h_chunk, w, b).float(), dim=-1)
                # Smoothed: the target gets 1 − ε and every class ε / V (torch's label_smoothing).
                target_log_prob = log_probs.gather(1, y[:, None]).squeeze(1) * (1 - label_smoothing)
                if label_smoothing:
                    target_log_prob += log_probs.mean(-1) * label_smoothing
                loss -= (target_log_prob * keep).sum()
                if grad_h is None and grad_w is None and grad_b is None:
                    continue
                # d CE / d logits = softmax − the smoothed one-hot, zero on the ignored positions; built in place.
                grad_logits = log_probs.exp_()
                grad_logits[torch.arange(len(y), device=y.device), y] -= 1 - label_smoothing
                if label_smoothing:
                    grad_logits -= label_smoothing / grad_logits.shape[-1]
                grad_logits *= keep[:, None]
                if grad_b is not None:
                    grad_b += grad_logits.sum(0)
                grad_logits = grad_logits.to(dtype)
                if grad_h is not None:
                    grad_h[start:end] = grad_logits @ w
                if grad_w is not None:  # accumulated in fp32 whatever the compute dtype
                    if dtype == torch.float32:
                        grad_w.addmm_(grad_logits.t(), h_chunk)  # no weight-sized temporary per chunk
                    else:
                        grad_w += grad_logits.t() @ h_chunk
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return (*gradients_formed_in_forward(ctx, grad_loss), None, None, None, None, None)


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int = -100,
    logits_per_chunk: int = LOGITS_PER_CHUNK,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_t CE(hidden_t Wᵀ + b, labels_t) over labels ≠ ignore_index, their count), no full logits.
    With `label_smoothing` ε each term is torch's smoothed cross-entropy, (1 − ε)·CE + ε·mean_v(−log p_v).

    `hidden` is (..., H) and `labels` the matching (...) targets, already aligned (shift causal-LM
    labels first with `shift_labels`).
    Equal to `F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, reduction="sum")` up to
    summation order (tested ≤ 1e-6 relative in the loss and ≤ 1e-5 in the gradients, in fp32).
    """
    flat_labels = labels.reshape(-1)
    # A mask, not an index of the targets: selecting them would cost a host sync per micro-batch.
    is_target = flat_labels != ignore_index
    loss = _LinearCrossEntropySum.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        flat_labels.masked_fill(~is_target, 0),
        is_target,
        max(1, logits_per_chunk // weight.shape[0]),
        torch.is_grad_enabled(),
        label_smoothing,
    )
    return loss, is_target.sum()


class _TokenLogProbs(torch.autograd.Function):
    """log p(token_ids) and the entropy from logits[:, :C], a chunk of positions at a time; the
    backward writes d log p(y) / dz = onehot(y) − softmax(z), times the incoming gradient, into one
    gradient buffer the size of `logits`, again a chunk at a time."""

    @staticmethod
    def forward(ctx, logits, token_ids, step):
        rows, length = token_ids.shape
        log_probs = torch.empty(rows, length, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(log_probs)
        for start in range(0, length, step):
            end = min(start + step, length)
            z = logits[:, start:end].float()
            log_z = torch.logsumexp(z, dim=-1)
            log_probs[:, start:end] = z.gather(-1, token_ids[:, start:end].unsqueeze(-1)).squeeze(-1) - log_z
            entropy[:, start:end] = log_z - torch.softmax(z, dim=-1).mul_(z).sum(-1)
        ctx.save_for_backward(logits, token_ids)
        ctx.step = step
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, token_ids = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for start in range(0, token_ids.shape[1], ctx.step):
            end = min(start + ctx.step, token_ids.shape[1])
            chunk = -torch.softmax(logits[:, start:end].float(), dim=-1)
            chunk.scatter_add_(-1, token_ids[:, start:end].unsqueeze(-1), torch.ones_like(chunk[..., :1]))
            grad[:, start:end] = chunk.mul_(grad_log_probs[:, start:end].unsqueeze(-1))
        return grad, None, None


def token_log_probs(
    logits: torch.Tensor, token_ids: torch.Tensor, logits_per_chunk: int = LOGITS_PER_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(token_ids) [B, C] in fp32, the entropy at those positions [B, C], detached) from
    `logits` [B, T ≥ C, V], position t predicting token_ids[:, t], without the fp32 copies of all
    of them that `log_softmax(logits.float())` keeps for its backward (at 16 × 256 tokens of a 49,152
    vocabulary, 0.8 GB each, several at its peak).

    log p(y) = z_y − logsumexp(z) and H = logsumexp(z) − Σ_v softmax(z)_v z_v, over chunks of
    positions of at most `logits_per_chunk` logits, in the forward and again in the backward (the
    gradient, (onehot(y) − softmax(z)) × the incoming one, is written into one buffer like `logits`,
    so positions past C get zero without a slice's extra copy). Equal to the unchunked form up to
    summation order (tests/test_output_loss.py).
    """
    rows, _, vocab = logits.shape
    step = max(1, logits_per_chunk // max(1, rows * vocab))
    return _TokenLogProbs.apply(logits, token_ids, step)


def target_spans(targets: torch.Tensor, ignore_index: int = -100) -> list[tuple[int, int]]:
    """Each row's [first target, last target + 1) (an empty span for a row with none). A preference
    pair's or a chat's prompt and padding are most of its positions, and none needs logits. Reading
    the bounds costs one host sync per batch: `OutputLoss`'s per-row path, a Python loop over rows
    already, trims its rows with it; the batch path keeps its mask (no sync)."""
    is_target = targets != ignore_index
    positions = torch.arange(targets.shape[1], device=targets.device)
    first = torch.where(is_target, positions, targets.shape[1]).amin(1)
    end = torch.where(is_target, positions + 1, 0).amax(1)
    return [(start, max(start, stop)) for start, stop in torch.stack([first, end], 1).tolist()]


class OutputLoss:
    """The summed loss of a model's output layer over its target tokens, chunked where that is exact.

    `loss_fn = OutputLoss(accelerator.unwrap_model(model), shift=True, accelerator=accelerator)`
    once, then `loss_sum, num_tokens = loss_fn(model, labels, **inputs)` for each micro-batch, where
    `model` is the prepared (possibly DDP-wrapped) model. `shift=True` for causal LMs (position t
    predicts t+1), False for encoder-decoders (the decoder input is already shifted). `self.path`
    says which path is used and why, for the banner. The memory planner traces this same call.
    """

    def __init__(
        self,
        unwrapped_model,
        *,
        shift: bool,
        accelerator=None,
        enabled: bool = True,
        check_logits: bool = True,
        trim_to_targets: bool = True,
        label_smoothing: float = 0.0,
    ):
        self.shift = shift
        self.label_smoothing = label_smoothing  # of the training loss (`__call__`); evaluation's rows stay plain
        self.trim_to_targets = trim_to_targets  # per-row losses over each row's target span only (target_spans)
        self.layer = unwrapped_model.get_output_embeddings()
        self.hidden: torch.Tensor | None = None
        distributed = getattr(accelerator, "distributed_type", None)
        sharded = distributed is not None and distributed.value in ("FSDP", "DEEPSPEED")
        reason = (
            "--no_chunked_loss" if not enabled
            else f"{distributed.value} shards the output layer" if sharded
            else f"the output layer is a {type(self.layer).__name__}, not a plain Linear"
            if type(self.layer) is not torch.nn.Linear else None
        )  # fmt: skip
        self.chunked = reason is None
        self.path = "chunked (no full logits)" if self.chunked else f"full logits ({reason})"
        self.checked = not (self.chunked and check_logits)  # the one-off check against the logits is still to run

    def _keep_input(self, module, args):
        self.hidden = args[0]
        return (args[0][..., :0, :], *args[1:])  # the layer computes zero logits

    def hidden_states(self, model, **inputs) -> torch.Tensor:
        """The output layer's input for `inputs`, from the model's own forward, with no logits computed."""
        handle = self.layer.register_forward_pre_hook(self._keep_input)
        try:
            model(**inputs)
        finally:
            handle.remove()
        hidden, self.hidden = self.hidden, None
        return hidden

    def _targets(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_labels(labels) if self.shift else labels

    def _full_logits_loss(self, logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0):
        if self.shift:
            return causal_lm_loss_sum(logits, labels, label_smoothing=label_smoothing)
        flat_logits, flat_labels = logits.float().flatten(0, 1), labels.flatten()
        loss = F.cross_entropy(
            flat_logits, flat_labels, ignore_index=-100, reduction="sum", label_smoothing=label_smoothing
        )
        return loss, (labels != -100).sum()

    @torch.no_grad()
    def check_against_logits(self, model, labels: torch.Tensor, inputs: dict) -> None:
        """Once, on one row in eval mode: chunked and unchunked losses agree, or fall back for good."""
        self.checked = True
        was_training = model.training
        model.eval()
        # One row, unless the inputs hold images, whose tensors need not have one entry per row (Qwen2-VL's
        # patches of all the batch's images): then the whole micro-batch.
        if not any(k.startswith(("pixel_", "image_")) for k in inputs):
            inputs, labels = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, labels[:1]
        full, _ = self._full_logits_loss(model(**inputs).logits, labels)
        chunked, _ = linear_cross_entropy_sum(
            self.hidden_states(model, **inputs), self.layer.weight, self.layer.bias, self._targets(labels)
        )
        model.train(was_training)
        if not torch.allclose(chunked, full, rtol=2e-2 if full.dtype != torch.float32 else 1e-4):
            self.chunked = False
            self.path = "full logits (the model changes its logits after the output layer)"

    def __call__(self, model, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ cross-entropy over the target tokens, their count) for one micro-batch."""
        if not self.checked:
            self.check_against_logits(model, labels, inputs)
        if not self.chunked:
            return self._full_logits_loss(model(**inputs).logits, labels, self.label_smoothing)
        hidden = self.hidden_states(model, **inputs)
        return linear_cross_entropy_sum(
            hidden, self.layer.weight, self.layer.bias, self._targets(labels), label_smoothing=self.label_smoothing
        )

    @torch.no_grad()
    def per_row(self, model, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's (summed loss, target count), for evaluation: no (batch × length × vocab) tensor either."""
        return self._rows(model, labels, inputs)

    def rows(self, model, labels: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's (summed loss, target count), differentiable: a preference loss needs every
        sequence's own log-probability (its negative summed loss)."""
        if not self.checked:
            self.check_against_logits(model, labels, inputs)
        return self._rows(model, labels, inputs)

    def _rows(self, model, labels: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.chunked:
            logits = model(**inputs).logits
            rows = [self._full_logits_loss(logits[i : i + 1], labels[i : i + 1]) for i in range(len(labels))]
        else:
            hidden, targets = self.hidden_states(model, **inputs), self._targets(labels)
            spans = target_spans(targets) if self.trim_to_targets else [(0, targets.shape[1])] * len(targets)
            rows = [
                linear_cross_entropy_sum(
                    hidden[i, start:end], self.layer.weight, self.layer.bias, targets[i, start:end]
                )
                for i, (start, end) in enumerate(spans)
            ]
        return torch.stack([loss for loss, _ in rows]), torch.stack([n for _, n in rows])

    @torch.no_grad()
    def mean_loss(self, model, dataloader, accelerator, model_inputs) -> float:
        """The loss per target token over a whole (evaluation) dataloader, on all processes together:
        the exact mean, Σ losses / Σ targets, not a mean of batch means. `model_inputs(batch)` picks
        the model's inputs; `gather_for_metrics` drops the rows Accelerate repeated to even out the
        last batch."""
        loss_sum, tokens = 0.0, 0
        for batch in dataloader:
            row_losses, row_tokens = accelerator.gather_for_metrics(
                self.per_row(model, batch["labels"], **model_inputs(batch))
            )
            loss_sum, tokens = loss_sum + row_losses.sum().item(), tokens + int(row_tokens.sum())
        return loss_sum / tokens
