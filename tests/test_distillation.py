"""recipes/distillation.py and its loss through both output layers (models/output_divergence.py):

- the update's gradient, from micro-batches of unequal conversations with a short last window, equals a
  direct full-batch evaluation of the formula (both models' full logits, Σ ℓ over every assistant token
  ÷ their number), for forward KL, JSD(0.5) and reverse KL, with and without --alpha; a mean of
  micro-batch means (TRL's GKD normalisation) does not;
- the recipe under 2 DDP processes on rows that do not divide makes the updates of one process;
- bad settings and a student of another vocabulary stop in one line.
The contract (8 × 1 = 2 × 4 on the recipe's own default, a bit-identical resume) is test_recipe_contract.py's.
"""

import functools
import json

import pytest
import torch
from conftest import assert_same_run, launch, read_metrics, recipe_args, run_in_process, write_jsonl

from ft_accum.core.distillation_loss import distillation_token_losses
from ft_accum.data import chat_data
from ft_accum.models.layer_selection import student_from_teacher
from ft_accum.models.output_divergence import DistillationLoss, full_logits_distillation_sum
from ft_accum.models.output_loss import shift_labels
from ft_accum.testing import make_conversations

SETTINGS = {
    "forward KL": (0.0, 0.0),
    "JSD 0.5": (0.5, 0.0),
    "reverse KL": (1.0, 0.0),
    "JSD 0.5, alpha 0.5": (0.5, 0.5),
}


@pytest.fixture(scope="module")
def models_and_batches():
    """A 2-layer Llama teacher of a 64-token vocabulary, its one-layer student (moved off the teacher's
    weights), and 21 rows of 6 to 40 tokens whose first third is a prompt (label -100), padded to each
    micro-batch's longest: micro-batches of 21, of 8, 8 and 5, and of 2 (× 10) and 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    teacher = LlamaForCausalLM(config).requires_grad_(False).eval()
    student, _ = student_from_teacher(teacher, 1)
    student.requires_grad_(True).train()
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(21):
        length = int(torch.randint(6, 41, (1,), generator=generator))
        ids = torch.randint(1, 64, (length,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (length // 3) + ids[length // 3 :]})
    collate = chat_data.collate_chats(0, packed=False)

    def split(sizes):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [collate(rows[s : s + n]) for s, n in zip(starts, sizes)]

    return student, teacher, split([21]), split([8, 8, 5]), split([2] * 10 + [1])


def gradient(student, loss_per_batch, batches):
    student.zero_grad()
    for batch in batches:
        loss_per_batch(batch).backward()
    return torch.cat([p.grad.flatten() for p in student.parameters()])


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("setting", SETTINGS, ids=list(SETTINGS))
def test_the_update_over_micro_batches_is_the_full_batch_formula(models_and_batches, setting):
    student, teacher, whole, thirds, pairs = models_and_batches
    beta, alpha = SETTINGS[setting]
    losses = functools.partial(distillation_token_losses, beta=beta, temperature=2.0, alpha=alpha)
    inputs = lambda b: {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}  # noqa: E731
    tokens = int((shift_labels(whole[0]["labels"]) != -100).sum())

    def formula(batch):  # the definition: both models' full logits, every assistant token, ÷ the update's tokens
        with torch.no_grad():
            teacher_logits = teacher(**inputs(batch)).logits
        loss, _ = full_logits_distillation_sum(
            student(**inputs(batch)).logits, teacher_logits, shift_labels(batch["labels"]), losses
        )
        return loss / tokens

    reference = gradient(student, formula, whole)
    distill = DistillationLoss(student, teacher, token_losses=losses)
    assert distill.path.startswith("chunked")
    ours = lambda batch: distill(student, teacher, batch["labels"], **inputs(batch))[0] / tokens  # noqa: E731
    for batches in (whole, thirds, pairs):
        # fp32 sums in another order: chunks, micro-batches of their own padding.
        assert relative_error(gradient(student, ours, batches), reference) <= 1e-5, len(batches)

    def mean_of_means(batch):  # each micro-batch ÷ its own tokens, ÷ the micro-batches (TRL's GKD)
        loss, count = distill(student, teacher, batch["labels"], **inputs(batch))
        return loss / count / len(pairs)

    assert relative_error(gradient(student, mean_of_means, pairs), reference) > 1e-3


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats")
    return {"train": write_jsonl(path / "train.jsonl", make_conversations(21, seed=1)),
            "validation": write_jsonl(path / "validation.jsonl", make_conversations(6, seed=2))}  # fmt: skip


def distillation_args(teacher, data, out, **settings):
    return recipe_args(None, data, out, teacher_name_or_path=teacher, max_seq_length=128, max_new_tokens=2, **settings)


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"student_layers": 3}, "--student_layers must be between 1 and the teacher's 2 layers"),
        ({"beta": 1.5}, "--beta must be in [0, 1]"),
        ({"temperature": 0}, "--temperature must be > 0"),
        ({"model_name_or_path": "TINY_GPT2"}, "different vocabularies"),
    ],
    ids=["student deeper than the teacher", "beta", "temperature", "another vocabulary"],
)
def test_bad_settings_are_one_line(tmp_path, chat_lm_dir, tiny_gpt2_dir, chat_files, settings, expected):
    settings = {k: (tiny_gpt2_dir if v == "TINY_GPT2" else v) for k, v in settings.items()}
    with pytest.raises(SystemExit) as exit_info:
        run_in_process("distillation", distillation_args(chat_lm_dir, chat_files, tmp_path / "out", **settings))
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and expected in message and "\n" not in message, message


@pytest.mark.launch
def test_two_ddp_processes_match_one_process_when_the_rows_do_not_divide(tmp_path, chat_lm_dir, chat_files):
    """21 conversations, forward KL with half cross-entropy, SGD: one process at 8 × 1 (8, 8, 5) and
    2 processes at 2 × 2 × 2, whose last window is short and uneven (process 1 holds repeats)."""
    settings = {"optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 0, "beta": 0.0, "alpha": 0.5}
    one, ddp = tmp_path / "one", tmp_path / "ddp"
    results = run_in_process(
        "distillation", distillation_args(chat_lm_dir, chat_files, one, per_device_train_batch_size=8, **settings)
    )
    assert 0 < results["eval_divergence"] and 0 <= results["eval_exact_match"] <= 1
    launch("distillation", distillation_args(chat_lm_dir, chat_files, ddp, per_device_train_batch_size=2,
           gradient_accumulation_steps=2, **settings), num_processes=2)  # fmt: skip
    assert json.loads((ddp / "all_results.json").read_text())["num_processes"] == 2
    assert [m["samples_seen"] for m in read_metrics(ddp)] == [8, 16, 21]
    assert_same_run(ddp, one)
