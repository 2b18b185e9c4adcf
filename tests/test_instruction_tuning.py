"""recipes/instruction_tuning.py: assistant-only labels on a real chat template, exact accumulation
over assistant tokens against the full batch (with the naive mean of means as the control that
must fail), packing without cross-talk, and the bad inputs of issue 18."""

import json

import pytest
import torch
from accelerate import Accelerator
from conftest import RTOL, launch, read_metrics, recipe_args, run_in_process, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from ft_accum.core.errors import ConfigError
from ft_accum.core.loss_normalization import causal_lm_loss_sum
from ft_accum.data import chat_data
from ft_accum.models.output_loss import OutputLoss
from ft_accum.testing import (
    copy_checkpoint,
    final_weights,
    make_conversations,
    make_tiny_chat_lm,
    max_abs_difference,
    relative_error,
    reset_accelerate_state,
)

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Which topic? Answer with one word."},
    {"role": "assistant", "content": "sport"},
    {"role": "user", "content": "And a headline?"},
    {"role": "assistant", "content": "Late goal wins the cup final"},
]


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats")
    return {
        "train": write_jsonl(path / "train.jsonl", make_conversations(16, seed=3)),
        "validation": write_jsonl(path / "validation.jsonl", make_conversations(6, seed=4)),
    }


def labelled_text(tokenizer, row) -> list[str]:
    """The decoded runs of labelled tokens, one per contiguous span."""
    spans, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != -100:
            current.append(token)
        elif current:
            spans, current = spans + [tokenizer.decode(current)], []
    return spans + ([tokenizer.decode(current)] if current else [])


@pytest.mark.parametrize("template", ["model's own (prefix by prefix)", "chatml (generation markers)"])
def test_exactly_the_assistant_answers_carry_labels(chat_lm_dir, template):
    tokenizer = AutoTokenizer.from_pretrained(chat_lm_dir)  # SmolLM2-135M-Instruct's real template
    chat_data.resolve_chat_template(tokenizer, "chatml" if template.startswith("chatml") else None, "tiny")
    assert ("{% generation %}" in tokenizer.chat_template) == template.startswith("chatml")
    row = chat_data.tokenize_chats(tokenizer, [CONVERSATION], max_length=512).rows[0]
    # Each answer with its end-of-turn marker (the model must learn to stop), nothing else: not the
    # system prompt, the user turns, or the "<|im_start|>assistant" headers.
    assert labelled_text(tokenizer, row) == ["sport<|im_end|>\n", "Late goal wins the cup final<|im_end|>\n"]
    assert row["labels"] == [t if label != -100 else -100 for t, label in zip(row["input_ids"], row["labels"])]


def test_truncation_is_counted_and_an_answerless_remainder_dropped(chat_lm_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_lm_dir)
    long_question = [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "yes"}]
    chats = chat_data.tokenize_chats(tokenizer, [CONVERSATION, long_question], max_length=40)
    assert chats.truncated == 2 and chats.dropped == 1 and len(chats.rows) == 1
    assert all(len(r["input_ids"]) == 40 for r in chats.rows)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_a_packed_row_has_the_loss_of_its_conversations_run_one_by_one(chat_lm_dir, attn_implementation):
    tokenizer = AutoTokenizer.from_pretrained(chat_lm_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_lm_dir, attn_implementation=attn_implementation)
    rows = chat_data.tokenize_chats(
        tokenizer, [r["messages"] for r in make_conversations(5, seed=9)], max_length=512
    ).rows
    packed = chat_data.pack_chats(rows, max_length=512)
    assert len(packed) == 1  # all five in one row
    batch = chat_data.collate_chats(tokenizer.pad_token_id, packed=True)(packed)

    one_by_one_loss, one_by_one_logits = 0.0, []
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]]), use_cache=False).logits
            one_by_one_loss += causal_lm_loss_sum(logits, torch.tensor([row["labels"]]))[0].item()
            one_by_one_logits.append(logits[0])
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        cross_talk = model(input_ids=batch["input_ids"], use_cache=False).logits  # the control: one causal sequence
    packed_loss = causal_lm_loss_sum(packed, batch["labels"])[0].item()
    expected = torch.cat(one_by_one_logits)

    assert abs(packed_loss - one_by_one_loss) / one_by_one_loss <= 1e-5
    assert rel(packed[0, : len(expected)], expected) <= 1e-5
    assert rel(cross_talk[0, : len(expected)], expected) > 1e-2  # later conversations would see earlier ones


def rel(a, b):
    return float((a - b).norm() / b.norm())


def naive_and_exact_gradients(model_dir, conversations, micro, accumulation):
    """The full-batch gradient, and the mean of per-micro-batch mean losses' gradient (`loss / N`)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = chat_data.tokenize_chats(tokenizer, conversations, max_length=512).rows[: micro * accumulation]
    collate = chat_data.collate_chats(tokenizer.pad_token_id, packed=False)
    loss_fn = OutputLoss(model, shift=True, accelerator=Accelerator(cpu=True))
    reset_accelerate_state()

    def grads(loss):
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])

    def loss_of(batch):
        return loss_fn(model, batch["labels"], input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    loss_sum, count = loss_of(collate(rows))
    full = grads(loss_sum / count)
    naive = sum(
        grads(torch.div(*loss_of(collate(rows[i : i + micro]))) / accumulation)
        for i in range(0, micro * accumulation, micro)
    )
    return full, naive


@pytest.mark.launch
def test_recipe_accumulation_matches_the_full_batch_and_two_ddp_processes(tmp_path, chat_lm_dir, chat_files):
    """(8 × 1) = (2 × 4) = 2 DDP processes × (2 × 2), with --label_smoothing and --neftune_noise_alpha on
    (issue 65: the smoothed loss divided once by the window's count, the noise seeded by row and update
    whatever the micro-batch), and a resume after update 1 bit-identical (the noise of update 2 again)."""
    answers = [len(m["messages"][1]["content"].split()) for m in make_conversations(16, seed=3)]
    assert max(answers) >= 10 * min(answers)  # the point: assistant lengths differ 10× or more

    def args(out, micro, accumulation, **more):
        return recipe_args(
            chat_lm_dir, chat_files, out, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
            max_train_samples=13, max_seq_length=512, exact_match_max_words=1, max_new_tokens=2,
            label_smoothing=0.1, neftune_noise_alpha=5, **more,
        )  # fmt: skip

    # 13 conversations: the second window holds 5, so on 2 processes (2 × 2) process 0's last
    # micro-batch is half padding and process 1's is all padding.
    run_in_process("instruction_tuning", args(tmp_path / "full", 8, 1))
    run_in_process("instruction_tuning", args(tmp_path / "accumulated", 2, 4, checkpointing_steps=1))
    resumed = copy_checkpoint(tmp_path / "accumulated", 1, tmp_path / "resumed")
    run_in_process("instruction_tuning", args(resumed, 2, 4, resume_from_checkpoint="latest"))
    assert max_abs_difference(final_weights(resumed), final_weights(tmp_path / "accumulated")) == 0.0
    launch("instruction_tuning", args(tmp_path / "ddp", 2, 2), num_processes=2)
    full = final_weights(tmp_path / "full")
    assert relative_error(final_weights(tmp_path / "accumulated"), full) <= RTOL
    assert relative_error(final_weights(tmp_path / "ddp"), full) <= RTOL
    assert json.loads((tmp_path / "ddp" / "all_results.json").read_text())["num_processes"] == 2
    for run in ("accumulated", "ddp"):
        assert [(r["samples_seen"], r["tokens_seen"]) for r in read_metrics(tmp_path / run)] == [
            (r["samples_seen"], r["tokens_seen"]) for r in read_metrics(tmp_path / "full")
        ]
    assert [r["samples_seen"] for r in read_metrics(tmp_path / "full")] == [8, 13]

    # The control, on the same conversations: the naive mean of per-micro-batch means is far off.
    exact, naive = naive_and_exact_gradients(chat_lm_dir, [m["messages"] for m in make_conversations(16, 3)], 2, 4)
    assert float((naive - exact).norm() / exact.norm()) > 1e-2  # measured 5.4e-2: 5,000× the bound above


@pytest.mark.parametrize(
    "rows, fragment",
    [
        ([{"messages": [{"role": "user", "content": "hi"}]}], "has no assistant turn"),
        ([{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}], "unknown role 'robot'"),
        ([{"messages": "just a string"}], "messages must be a non-empty list"),
        ([{"question": "hi", "answer": "x"}], "question, answer are in no conversation format read here: messages"),
        ([{"conversations": [{"from": "bot", "value": "x"}]}], "unknown role 'bot'.*ShareGPT's human, gpt"),
    ],
)  # fmt: skip
def test_bad_conversations_stop_with_one_line(tmp_path, chat_lm_dir, rows, fragment):
    data = {s: write_jsonl(tmp_path / f"{s}.jsonl", rows * 4) for s in ("train", "validation")}
    with pytest.raises(SystemExit, match="^error: [^\n]*" + fragment.replace("(", r"\(") + "[^\n]*$"):
        run_in_process("instruction_tuning", recipe_args(chat_lm_dir, data, tmp_path / "out", max_train_steps=1))


def test_sharegpt_and_alpaca_rows_train_exactly_as_their_messages(tmp_path, chat_lm_dir, chat_files):
    """The same single-turn conversations (with and without an input, with a system prompt) as
    messages, as ShareGPT and as Alpaca: the three runs end bit-identical."""
    chats = [m["messages"][:2] for m in make_conversations(12, seed=8)]
    alpaca = [{"instruction": user["content"], "input": "in" * (i % 2), "output": answer["content"],
               "system": "Be brief." * (i % 3 == 0)} for i, (user, answer) in enumerate(chats)]  # fmt: skip
    messages = [{"messages": chat_data.to_messages(row, "alpaca", "", "", "")} for row in alpaca]
    sharegpt = [{"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[t["role"]],
                                    "value": t["content"]} for t in m["messages"]]} for m in messages]  # fmt: skip
    assert any(len(m["messages"]) == 3 for m in messages) and any(
        "\n\nin" in m["messages"][-2]["content"] for m in messages
    )
    weights = {}
    for name, rows in (("messages", messages), ("sharegpt", sharegpt), ("alpaca", alpaca)):
        data = {"train": write_jsonl(tmp_path / f"{name}.jsonl", rows), "validation": chat_files["validation"]}
        run_in_process("instruction_tuning", recipe_args(chat_lm_dir, data, tmp_path / name, max_train_steps=2,
                                                         per_device_train_batch_size=4, max_new_tokens=2))  # fmt: skip
        weights[name] = final_weights(tmp_path / name)
    assert max_abs_difference(weights["sharegpt"], weights["messages"]) == 0.0
    assert max_abs_difference(weights["alpaca"], weights["messages"]) == 0.0


def test_a_model_without_a_chat_template_needs_one(tmp_path, chat_lm_dir):
    tokenizer = AutoTokenizer.from_pretrained(chat_lm_dir)
    tokenizer.chat_template = None
    with pytest.raises(ConfigError, match="no chat template; pass --chat_template chatml"):
        chat_data.resolve_chat_template(tokenizer, None, "tiny")


def test_packing_with_lora_runs_and_resumes(tmp_path, chat_lm_dir, chat_files, capsys):
    args = recipe_args(
        chat_lm_dir, chat_files, tmp_path / "out", per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_train_steps=3, max_seq_length=256, checkpointing_steps=1, max_new_tokens=2,
    )  # fmt: skip
    run_in_process("instruction_tuning", [*args, "--packing", "--use_lora", "--lora_r=4", "--max_train_steps=2"])
    banner = capsys.readouterr().out
    assert "packed into" in banner and "assistant tokens" in banner and "chunked" in banner
    run_in_process(
        "instruction_tuning", [*args, "--packing", "--use_lora", "--lora_r=4", "--resume_from_checkpoint=latest"]
    )
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3] and 0 <= results["eval_exact_match"] <= 1
    assert (tmp_path / "out" / "final" / "adapter_config.json").is_file()


def test_a_bert_style_tokenizer_gets_through_generation(tmp_path, chat_files, lm_data_files):
    """The bundled MiniLM's tokenizer returns token_type_ids too, which a causal LM's generate()
    refuses: both recipes that generate (the exact-match score here, --generate_prompt in the causal
    LM recipe) pass it only input_ids and the attention mask."""
    from ft_accum.data.offline_assets import bundled_minilm_dir

    model_dir = make_tiny_chat_lm(tmp_path / "model", tokenizer_dir=bundled_minilm_dir())
    assert "token_type_ids" in AutoTokenizer.from_pretrained(model_dir)("a test")
    settings = dict(max_train_steps=1, max_new_tokens=2)
    run_in_process("instruction_tuning", [*recipe_args(model_dir, chat_files, tmp_path / "chat", **settings),
                                          "--chat_template=chatml"])  # fmt: skip
    assert 0 <= json.loads((tmp_path / "chat" / "all_results.json").read_text())["eval_exact_match"] <= 1
    lm_args = recipe_args(model_dir, lm_data_files, tmp_path / "lm", generate_prompt="the match", **settings)
    run_in_process("causal_lm", [*lm_args, "--block_size=32"])
    assert json.loads((tmp_path / "lm" / "all_results.json").read_text())["sample"].startswith("the match")
