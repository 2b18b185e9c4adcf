"""The chunked output-layer loss against the unchunked one (issue 16): same loss, same gradients,
no (batch × length × vocabulary) logits. fp32, so the only difference is summation order."""

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from conftest import make_tiny_lm
from transformers import AutoModelForCausalLM, T5Config, T5ForConditionalGeneration

from ft_accum.core.loss_normalization import causal_lm_loss_sum
from ft_accum.models.output_loss import OutputLoss, linear_cross_entropy_sum, shift_labels, token_log_probs
from ft_accum.planner import configs, tracing
from ft_accum.testing import reset_accelerate_state


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.fixture()
def accelerator():
    yield Accelerator(cpu=True)
    reset_accelerate_state()


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_linear_cross_entropy_matches_the_unchunked_loss_and_gradients(with_bias, label_smoothing):
    torch.manual_seed(0)
    hidden = torch.randn(3, 17, 24, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(101, 24) * 0.3).requires_grad_()
    bias = torch.randn(101).requires_grad_() if with_bias else None
    labels = torch.randint(0, 101, (3, 17))
    labels[0, 10:] = -100  # padding
    labels[2, :3] = -100  # a masked prompt
    inputs = [hidden, weight] + ([bias] if with_bias else [])

    logits = F.linear(hidden, weight, bias).flatten(0, 1)
    reference = F.cross_entropy(logits, labels.flatten(), reduction="sum", label_smoothing=label_smoothing)
    expected = torch.autograd.grad(reference, inputs)
    # 101 logits per chunk: one row per chunk, 51 chunks.
    loss, count = linear_cross_entropy_sum(
        hidden, weight, bias, labels, logits_per_chunk=101, label_smoothing=label_smoothing
    )
    got = torch.autograd.grad(loss * 0.37, inputs)  # a scale, as the recipe's /nominal_tokens, must carry through

    assert count == (labels != -100).sum()
    assert abs(loss.item() - reference.item()) / reference.item() <= 1e-6
    for g, e in zip(got, expected):
        assert rel(g, 0.37 * e) <= 1e-5
    assert rel(expected[0][0, 10:], torch.zeros(7, 24)) == 0 or expected[0][0, 10:].abs().max() == 0
    assert got[0][0, 10:].abs().max() == 0  # padding gets no gradient


def test_without_grad_mode_the_chunked_loss_computes_no_gradients():
    """Evaluation and DPO's reference pass run under torch.no_grad(), where an autograd Function's
    needs_input_grad still says True: the loss must then run one matmul per chunk (the logits), not
    three (with the gradients of h and W), and hold no fp32 copy of the output layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    hidden, weight = torch.randn(40, 16).requires_grad_(), torch.randn(50, 16).requires_grad_()
    labels = torch.randint(0, 50, (40,))
    with torch.no_grad(), CountMatmuls() as counted:
        loss, _ = linear_cross_entropy_sum(hidden, weight, None, labels, logits_per_chunk=500)  # 10 rows a chunk
    assert counted.count == 4  # the logits of 4 chunks, nothing else
    assert torch.equal(loss, linear_cross_entropy_sum(hidden, weight, None, labels, logits_per_chunk=500)[0])


def test_causal_lm_output_loss_equals_the_logits_loss_with_padding(tmp_path, accelerator):
    model = AutoModelForCausalLM.from_pretrained(make_tiny_lm("llama", tmp_path))
    model.config.tie_word_embeddings = True  # a tied output layer: two gradient paths into one weight
    torch.manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (4, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    mask[3, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    params = [p for p in model.parameters() if p.requires_grad]

    reference, ref_count = causal_lm_loss_sum(model(input_ids=ids, attention_mask=mask).logits, labels)
    expected = torch.autograd.grad(reference, params)
    loss_fn = OutputLoss(model, shift=True, accelerator=accelerator)
    loss, count = loss_fn(model, labels, input_ids=ids, attention_mask=mask)
    got = torch.autograd.grad(loss, params)

    assert loss_fn.chunked and loss_fn.path.startswith("chunked"), loss_fn.path
    assert count == ref_count == (shift_labels(labels) != -100).sum()
    assert abs(loss.item() - reference.item()) / reference.item() <= 1e-6
    assert max(rel(g, e) for g, e in zip(got, expected)) <= 1e-5

    rows, row_counts = loss_fn.per_row(model, labels, input_ids=ids, attention_mask=mask)
    assert row_counts.sum() == count and abs(rows.sum().item() - reference.item()) / reference.item() <= 1e-6


def test_per_row_losses_run_the_head_on_each_rows_target_span_only(tmp_path, accelerator):
    """A preference loss weighs each sequence's log-probability by its own coefficient: each row's loss
    and the gradient of a weighted sum must equal the logits path's, while the output layer sees only
    the positions from each row's first target to its last (not its prompt, padding, or a row with no
    target at all)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HeadRows(TorchDispatchMode):  # the positions the output layer computes logits for
        def __init__(self, vocab):
            super().__init__()
            self.vocab, self.rows = vocab, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == self.vocab:
                self.rows += out.shape[0]
            return out

    model = AutoModelForCausalLM.from_pretrained(make_tiny_lm("llama", tmp_path))
    torch.manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (4, 20))
    mask = torch.ones_like(ids)
    mask[0, 14:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :6] = -100  # a prompt
    labels[2] = -100  # a row with no target
    labels[3, 9:12] = -100  # a gap inside the span: still computed, not counted
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.tensor([0.5, -1.5, 2.0, 0.25])

    logits = model(input_ids=ids, attention_mask=mask).logits
    reference = torch.stack([causal_lm_loss_sum(logits[i : i + 1], labels[i : i + 1])[0] for i in range(4)])
    expected = torch.autograd.grad((weights * reference).sum(), params)
    loss_fn = OutputLoss(model, shift=True, accelerator=accelerator, check_logits=False)
    with HeadRows(model.config.vocab_size) as head:
        rows, counts = loss_fn.rows(model, labels, input_ids=ids, attention_mask=mask)
    got = torch.autograd.grad((weights * rows).sum(), params)

    targets = shift_labels(labels)
    assert counts.tolist() == (targets != -100).sum(1).tolist() and counts[2] == 0
    assert rel(rows, reference) <= 1e-6
    assert max(rel(g, e) for g, e in zip(got, expected)) <= 1e-5
    # spans after the shift: rows 0 and 1 from position 5 to 13 and 19 (exclusive), row 3 from 5 to 19
    assert head.rows == (13 - 5) + (19 - 5) + 0 + (19 - 5)


def test_seq2seq_output_loss_equals_the_logits_loss(accelerator):
    config = T5Config(
        vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)  # tied: its decoder output is scaled by d_model^-0.5 before the head
    ids, labels = torch.randint(1, 50, (3, 9)), torch.randint(1, 50, (3, 7))
    labels[0, 4:] = -100
    inputs = {"input_ids": ids, "decoder_input_ids": model.prepare_decoder_input_ids_from_labels(labels=labels)}
    params = list(model.parameters())

    logits = model(**inputs).logits
    reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    expected = torch.autograd.grad(reference, params, allow_unused=True)
    loss_fn = OutputLoss(model, shift=False, accelerator=accelerator)
    loss, count = loss_fn(model, labels, **inputs)
    got = torch.autograd.grad(loss, params, allow_unused=True)

    assert loss_fn.chunked and count == (labels != -100).sum()
    assert abs(loss.item() - reference.item()) / reference.item() <= 1e-6
    assert max(rel(g, e) for g, e in zip(got, expected) if e is not None) <= 1e-5


def test_a_model_that_changes_its_logits_after_the_output_layer_falls_back(tmp_path, accelerator):
    model = AutoModelForCausalLM.from_pretrained(make_tiny_lm("gpt2", tmp_path))

    def scale_logits(module, args, output):  # as Cohere's logit_scale does
        output.logits = output.logits * 4.0
        return output

    model.register_forward_hook(scale_logits)
    ids = torch.randint(3, model.config.vocab_size, (2, 10))
    loss_fn = OutputLoss(model, shift=True, accelerator=accelerator)
    loss, _ = loss_fn(model, ids, input_ids=ids)
    reference, _ = causal_lm_loss_sum(model(input_ids=ids).logits, ids)

    assert not loss_fn.chunked and "after the output layer" in loss_fn.path
    assert torch.equal(loss, reference)


def test_disabled_or_wrapped_output_layers_take_the_logits_path(tmp_path, accelerator):
    model = AutoModelForCausalLM.from_pretrained(make_tiny_lm("gpt2", tmp_path))
    assert (
        OutputLoss(model, shift=True, accelerator=accelerator, enabled=False).path == "full logits (--no_chunked_loss)"
    )
    model.lm_head = torch.nn.Sequential(model.lm_head)
    assert "not a plain Linear" in OutputLoss(model, shift=True, accelerator=accelerator).path


def test_under_bf16_autocast_the_chunked_loss_runs_the_head_in_bf16_like_the_model(tmp_path, accelerator):
    model = AutoModelForCausalLM.from_pretrained(make_tiny_lm("gpt2", tmp_path))
    ids = torch.randint(3, model.config.vocab_size, (2, 30))
    loss_fn = OutputLoss(model, shift=True, accelerator=accelerator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference, _ = causal_lm_loss_sum(model(input_ids=ids).logits, ids)
        loss, _ = loss_fn(model, ids, input_ids=ids)
    assert loss.dtype == torch.float32 and loss_fn.chunked
    assert abs(loss.item() - reference.item()) / reference.item() <= 1e-3


def test_the_chunked_step_keeps_far_fewer_bytes_alive_than_the_logits_path():
    """The planner's tracker on the real tensors of one step: a 49k-entry vocabulary, 4 × 512 tokens
    (three chunks of the output layer); 128 wide, since the width scales the time, not the logits."""
    config = configs.load_model_config("gpt2-124m")
    config.n_layer, config.vocab_size, config.n_embd, config.n_head = 1, 49152, 128, 2
    peaks = {}
    for loss_path in ("chunked", "logits", "model"):
        forward_backward, _ = tracing.trace_phases(
            config, task="causal_lm", micro_batch_size=4, seq_len=512, loss_path=loss_path, real_tensors=True
        )
        peaks[loss_path] = forward_backward.activations_gradients_temporaries
    logits_bytes = 4 * 512 * 49152 * 4
    assert peaks["logits"] - peaks["chunked"] >= 1.5 * logits_bytes, peaks
    assert peaks["model"] - peaks["chunked"] >= 1.5 * logits_bytes, peaks  # the plain loop's and Trainer's loss


def unchunked_token_log_probs(logits, token_ids):
    """The form token_log_probs replaces: every position's fp32 log-softmax at once."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).detach()[:, : token_ids.shape[1]]  # at the tokens' positions
    return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1), entropy


@pytest.mark.parametrize("logits_per_chunk", [1 << 25, 3 * 50])  # one chunk; chunks of 1 position (3 rows × 50)
def test_token_log_probs_match_the_unchunked_log_softmax_and_its_gradient(logits_per_chunk):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50, dtype=torch.float64)).requires_grad_()
    ids, weights = torch.randint(0, 50, (3, 7)), torch.randn(3, 7, dtype=torch.float64)
    ours, entropy = token_log_probs(logits, ids, logits_per_chunk=logits_per_chunk)
    (grad,) = torch.autograd.grad((ours * weights).sum(), logits)
    reference, reference_entropy = unchunked_token_log_probs(logits, ids)
    (reference_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
    torch.testing.assert_close(ours, reference.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, reference_entropy.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-6, atol=1e-6)
    assert not entropy.requires_grad
    with torch.no_grad():
        assert not token_log_probs(logits, ids, logits_per_chunk=logits_per_chunk)[0].requires_grad


def test_the_grpo_step_keeps_fewer_copies_of_the_completion_logits():
    """The planner's tracker on the real tensors of recipes/grpo.py's step (4 completions of 256
    tokens, a 49k vocabulary; chunks of 2M logits, so that they are small beside the 50M, as the
    default's 32M are beside a GPU step's): against the unchunked log-softmax, at least 1.5 copies
    of the completion's fp32 logits fewer at the peak (measured: 1.9; what stays is the logits and
    their gradient, which the output layer's backward needs)."""
    import functools
    from unittest import mock

    from ft_accum.training import generation_round

    config = configs.load_model_config("gpt2-124m")
    config.n_layer, config.vocab_size, config.n_embd, config.n_head = 1, 49152, 128, 2
    settings = dict(task="grpo", micro_batch_size=4, seq_len=288, completion_length=256, real_tensors=True)
    small_chunks = functools.partial(token_log_probs, logits_per_chunk=1 << 21)
    with mock.patch.object(generation_round, "token_log_probs", small_chunks):
        chunked = tracing.trace_phases(config, **settings)[0].activations_gradients_temporaries
    with mock.patch.object(generation_round, "token_log_probs", unchunked_token_log_probs):
        unchunked = tracing.trace_phases(config, **settings)[0].activations_gradients_temporaries
    fp32_logits = 4 * 256 * 49152 * 4
    assert unchunked - chunked >= 1.5 * fp32_logits, (unchunked, chunked)
