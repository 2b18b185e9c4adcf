"""recipes/distillation.py and its loss through both output layers (models/output_divergence.py):

- the update's gradient, from micro-batches of unequal conversations with a short last window, equals a
  direct full-batch evaluation of the formula (both models' full logits, Σ ℓ over every assistant token
  ÷ their number), for forward KL, JSD(0.5) and reverse KL, with and without --alpha; a mean of
  micro-batch means (TRL's GKD normalisation) does not;
- with --lmbda 0.5 the student answers the same sequences, with the same tokens, at every split;
- the recipe under 2 DDP processes on rows that do not divide, on-policy, makes the updates of one process;
- bad settings and a student of another vocabulary stop in one line.
The contract (8 × 1 = 2 × 4 on the recipe's own default, a bit-identical resume) is test_recipe_contract.py's.
"""

import functools
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_same_run, launch, read_metrics, recipe_args, run_in_process, write_jsonl

from ft_accum.core.distillation_loss import distillation_token_losses
from ft_accum.data import chat_data
from ft_accum.models.layer_selection import student_from_teacher
from ft_accum.models.output_divergence import DistillationLoss, full_logits_distillation_sum
from ft_accum.models.output_loss import shift_labels
from ft_accum.testing import make_conversations, make_tiny_chat_lm
from ft_accum.training import on_policy

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


def test_the_student_answers_the_same_sequences_at_every_split(models_and_batches):
    """λ 0.5 over 21 rows at update 3: which rows the student answers and what it answers, by row,
    are the same in one micro-batch of 21, in 8, 8, 5, and in 2 (× 10) and 1 (the Accelerator is
    a single CPU process: sampling runs on the unwrapped model either way)."""
    from accelerate import Accelerator

    student, _, whole, _, _ = models_and_batches
    rows = on_policy.unpadded_rows({**whole[0], "row_index": torch.arange(21)})
    collate = chat_data.collate_chats(0, packed=False)
    settings = on_policy.OnPolicy(0.5, 7, 12, 48, 1.0, eos_token_id=2, pad_token_id=0)
    answers = on_policy.StudentAnswers(Accelerator(cpu=True), student, settings)
    by_split = []
    for sizes in ([21], [8, 8, 5], [2] * 10 + [1]):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        answered = [answers(collate(rows[s : s + n]), update=3) for s, n in zip(starts, sizes)]
        by_split.append(
            {r["row_index"]: (r["input_ids"], r["labels"]) for b in answered for r in on_policy.unpadded_rows(b)}
        )
        assert answers.columns() == {"on_policy_sequences": answers_count(by_split[-1], rows)}
    assert by_split[0] == by_split[1] == by_split[2]
    assert 0 < answers_count(by_split[0], rows) < 21, "λ 0.5 answered none or all: the comparison would be empty"
    assert student.training, "sampling left the student in eval mode"


def test_on_policy_under_a_sharded_engine_on_several_processes_is_refused():
    """Each rank samples its own rows, one generate() each: a sharded model would wait for ever."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from ft_accum.core.errors import ConfigError

    settings = on_policy.OnPolicy(0.5, 0, 8, 64, 1.0, eos_token_id=2, pad_token_id=0)
    for engine in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(ConfigError, match="sharded engine.*multi_gpu_ddp.yaml"):
            on_policy.StudentAnswers(SimpleNamespace(distributed_type=engine, num_processes=2), None, settings)
    one_process = SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=1)
    assert on_policy.StudentAnswers(one_process, None, settings).settings is settings


def answers_count(answered, rows):
    return sum(answered[r["row_index"]][0] != r["input_ids"] for r in rows)


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
        ({"lmbda": 1.5}, "--lmbda must be in [0, 1]"),
        ({"lmbda": 0.5, "alpha": 0.5}, "add --alpha 0"),
        ({"model_name_or_path": "TINY_GPT2"}, "different vocabularies"),
    ],
    ids=["student deeper than the teacher", "beta", "temperature", "lmbda", "lmbda with alpha", "another vocabulary"],
)
def test_bad_settings_are_one_line(tmp_path, chat_lm_dir, tiny_gpt2_dir, chat_files, settings, expected):
    settings = {k: (tiny_gpt2_dir if v == "TINY_GPT2" else v) for k, v in settings.items()}
    with pytest.raises(SystemExit) as exit_info:
        run_in_process("distillation", distillation_args(chat_lm_dir, chat_files, tmp_path / "out", **settings))
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and expected in message and "\n" not in message, message


def test_a_4_bit_teacher_teaches_and_the_student_exports_to_gguf(tmp_path, chat_lm_dir, chat_files, capsys):
    """--teacher_load_in_4bit: the student is built from the full-precision layers, then the teacher
    is loaded again in NF4 (the banner reads its weights' dtypes: uint8 holds two 4-bit weights).
    The student (one of the teacher's two layers) is a Llama like any other: `ft-accum export` writes
    its GGUF and checks it in llama.cpp against transformers."""
    from ft_accum.cli.main import main
    from ft_accum.export import llamacpp_check

    out = tmp_path / "out"
    results = run_in_process(
        "distillation", distillation_args(chat_lm_dir, chat_files, out, teacher_load_in_4bit=True, max_train_steps=1)
    )
    banner = capsys.readouterr().out.splitlines()
    teacher_line = next(line for line in banner if "teacher" in line and "frozen" in line)
    assert "uint8" in teacher_line, teacher_line
    assert 0 < results["eval_divergence"] < float("inf") and len(read_metrics(out)) == 1
    assert main(["export", str(out), "--format", "gguf", "--outtype", "f32"]) == 0
    (entry,) = json.loads((out / "exports.json").read_text())["exports"]
    assert Path(entry["file"]).stat().st_size > 0
    assert "recipes/distillation.py" in (out / "final" / "README.md").read_text()
    if llamacpp_check.llamacpp_available():
        assert entry["verification"].startswith("llama.cpp: greedy top-1 identical"), entry["verification"]


def test_a_lora_runs_final_folder_loads_as_its_base_with_the_adapter_merged(tmp_path, chat_lm_dir):
    """--teacher_name_or_path RUN/final of a LoRA run (adapter_config.json, no config.json) goes through
    the recipes' `load_causal_lm`: the base with the adapter merged in (peft's unmerged pair's logits,
    not the base's), every weight trainable again (a student built from it trains), and a 4-bit load
    of it is refused in one line (4-bit weights cannot take the merge)."""
    import peft
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ft_accum.core.errors import ConfigError
    from ft_accum.models.loading import load_causal_lm

    adapter = tmp_path / "final"
    base = AutoModelForCausalLM.from_pretrained(chat_lm_dir).eval()
    pair = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(chat_lm_dir), peft.LoraConfig(r=4, init_lora_weights=False)
    )
    pair.save_pretrained(adapter)
    AutoTokenizer.from_pretrained(chat_lm_dir).save_pretrained(adapter)
    load = functools.partial(load_causal_lm, str(adapter), Accelerator(cpu=True), model_dtype="float32",
                             torch_compile=False, trust_remote_code=False, frozen_base=False)  # fmt: skip
    merged = load()
    assert all(p.requires_grad for p in merged.parameters()) and not hasattr(merged, "peft_config")
    ids = torch.tensor([[1, 5, 9, 200, 3000]])
    with torch.no_grad():
        logits = merged.eval()(ids).logits
        assert torch.allclose(logits, pair.eval()(ids).logits, atol=1e-5)
        assert not torch.allclose(logits, base(ids).logits, atol=1e-3)
    with pytest.raises(ConfigError, match="is a LoRA adapter.*final_merged"):
        load(load_in_4bit=True)


@pytest.mark.launch
def test_two_ddp_processes_match_one_process_when_the_rows_do_not_divide(tmp_path, chat_lm_dir, chat_files):
    """21 conversations, forward KL, half of them answered by the student (--lmbda 0.5), SGD: one
    process at 8 × 1 (8, 8, 5) and 2 processes at 2 × 2 × 2, whose last window is short and uneven
    (process 1 holds repeats). Equal updates need the same answers, sampled on other processes.
    The student is the teacher with its EOS row × 60: a divergence far from 0 (a student of the
    teacher's own layers is within 1e-4 of it, where fp32 cancellation alone is 1e-5 relative), and
    answers that stop early at some positions and run to the limit at others."""
    student = make_tiny_chat_lm(tmp_path / "student", eos_scale=60.0)
    settings = {"optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 0, "beta": 0.0, "alpha": 0.0, "lmbda": 0.5,
                "model_name_or_path": str(student), "max_completion_length": 8}  # fmt: skip
    one, ddp = tmp_path / "one", tmp_path / "ddp"
    results = run_in_process(
        "distillation", distillation_args(chat_lm_dir, chat_files, one, per_device_train_batch_size=8, **settings)
    )
    assert 0 < results["eval_divergence"] and 0 <= results["eval_exact_match"] <= 1
    launch("distillation", distillation_args(chat_lm_dir, chat_files, ddp, per_device_train_batch_size=2,
           gradient_accumulation_steps=2, **settings), num_processes=2)  # fmt: skip
    assert json.loads((ddp / "all_results.json").read_text())["num_processes"] == 2
    assert [m["samples_seen"] for m in read_metrics(ddp)] == [8, 16, 21]
    answered = [m["on_policy_sequences"] for m in read_metrics(ddp)]
    assert answered == [m["on_policy_sequences"] for m in read_metrics(one)] and 0 < sum(answered) < 21
    assert_same_run(ddp, one)
