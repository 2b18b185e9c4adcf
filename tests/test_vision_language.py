"""recipes/vision_language.py and its library (issue 63): answer-only labels beside image tokens, the
exact update over answer tokens against the full batch on Idefics3 (SmolVLM), Qwen2-VL (whose
`pixel_values` are flattened over the batch's images) and LLaVA (one entry per image), with the two usual errors as controls that
must fail (a mean of micro-batch means; a count that includes image tokens), the zero-weighted
vision pass, whole images under row splitting, truncation, final/ round trip, and bad input."""

import json

import pytest
import torch
from conftest import RTOL, error_of, launch, read_metrics, recipe_args, run_in_process, write_jsonl
from transformers import AutoModelForImageTextToText, AutoProcessor

from ft_accum.core.errors import ConfigError
from ft_accum.data import vision_chat_data as vision_data
from ft_accum.models import vision_language
from ft_accum.models.output_loss import OutputLoss
from ft_accum.testing import (
    final_weights,
    make_tiny_idefics3,
    make_tiny_llava,
    make_tiny_qwen2_vl,
    relative_error,
    reset_accelerate_state,
    write_vision_conversations,
)
from ft_accum.training.windows import split_rows, take_rows


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory, chat_lm_dir):
    """(model folder, processor) of a tiny Idefics3 with SmolLM2's tokenizer; 7 tokens per image."""
    path = make_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"), chat_lm_dir)
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    return path, processor


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory, chat_lm_dir):
    path, processor = make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"), chat_lm_dir)
    processor.tokenizer.padding_side = "right"
    return path, processor


@pytest.fixture(scope="module")
def llava(tmp_path_factory, chat_lm_dir):
    path = make_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), chat_lm_dir)
    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "right"
    return path, processor


@pytest.fixture(scope="module")
def vision_files(tmp_path_factory):
    """13 rows, of which one has 2 images and one has 1: every window on 2 processes × (2 × 2) holds
    micro-batches with no image. Images as files relative to the data file."""
    path = tmp_path_factory.mktemp("vision-chats")
    counts = (2, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0)
    return {
        "train": write_vision_conversations(path / "train", 13, seed=1, image_counts=counts),
        "validation": write_vision_conversations(path / "validation", 4, seed=2, image_counts=(1, 0)),
    }


def conversations(folder, n, seed, image_counts=(2, 0, 1, 0, 1, 2)):
    """`vision_conversations_of`'s rows for generated data (rows of 0, 1 and 2 images)."""
    import datasets

    data = write_vision_conversations(folder, n, seed, image_counts)
    raw = {"train": datasets.load_dataset("json", data_files=str(data), split="train")}
    return vision_data.vision_conversations_of(raw, "messages", "images", {"train": folder})["train"]


def tokenized(processor, model_dir, rows, max_length=512):
    from transformers import AutoConfig

    image_ids = vision_data.image_token_ids(processor, AutoConfig.from_pretrained(model_dir))
    return vision_data.tokenize_vision_chats(processor, rows, max_length, image_ids)


@pytest.mark.parametrize("arch", ["idefics3", "qwen2_vl", "llava"])
def test_only_the_answers_carry_labels(request, tmp_path, arch):
    model_dir, processor = request.getfixturevalue(arch)
    rows = conversations(tmp_path, 6, seed=5)
    chats = tokenized(processor, model_dir, rows)
    image_ids = vision_data.image_token_ids(processor, AutoModelForImageTextToText.from_pretrained(model_dir).config)
    for (messages, _, _), row in zip(rows, chats.rows):
        labelled = processor.tokenizer.decode([t for t in row["labels"] if t != -100])
        assert labelled == messages[-1]["content"][0]["text"] + "<|im_end|>\n"
        assert not image_ids & set(row["labels"])
    assert chats.images == 6 and chats.image_tokens > 6  # every image is several tokens, none of them a target


def test_a_cut_falls_after_the_images_or_the_row_is_dropped(tmp_path, idefics3):
    model_dir, processor = idefics3
    rows = conversations(tmp_path, 3, seed=6, image_counts=(2, 0, 1))
    full = tokenized(processor, model_dir, rows)
    lengths = [len(r["input_ids"]) for r in full.rows]
    images_end = max(i for i, t in enumerate(full.rows[0]["input_ids"]) if t == processor.image_token_id) + 2
    cut = tokenized(processor, model_dir, rows, max_length=images_end + 2)  # row 0 keeps its images and 1 token
    assert cut.truncated >= 1 and all(len(r["input_ids"]) <= images_end + 2 for r in cut.rows)
    dropped = tokenized(processor, model_dir, rows, max_length=images_end - 3)  # inside row 0's second image
    assert dropped.dropped >= 1 and len(dropped.rows) < len(rows) and min(lengths) > 0
    with pytest.raises(ConfigError, match="an image takes 7 tokens, more than --max_seq_length 5"):
        tokenized(processor, model_dir, rows, max_length=5)


def test_row_splits_take_whole_images(tmp_path, qwen2_vl):
    """Qwen2-VL's pixel_values hold the patches of all the batch's images: cutting the batch by rows
    (Accelerate's repeated rows, --auto_micro_batch) gives each piece its own rows' images, the same
    tensors as collating those rows alone."""
    model_dir, processor = qwen2_vl
    rows = tokenized(processor, model_dir, conversations(tmp_path, 6, seed=7)).rows
    collate = vision_data.collate_vision_chats(processor, processor.tokenizer.pad_token_id)
    batch = collate(rows)
    assert batch["pixel_values"].shape[0] == 16 * 6 and batch["image_grid_thw"].shape[0] == 6
    for start, piece in zip(range(0, 6, 4), split_rows(batch, 4)):
        alone = collate(rows[start : start + 4])
        for key in ("pixel_values", "image_grid_thw", "num_images"):
            assert torch.equal(piece[key], alone[key]), key
        length = alone["input_ids"].shape[1]
        assert torch.equal(piece["input_ids"][:, :length], alone["input_ids"])
    assert take_rows(batch, 1)["pixel_values"].shape[0] == 32  # row 0's two images, whole


def blank_vision_pass(model, processor):
    from accelerate import Accelerator

    vision_pass = vision_language.BlankVisionPass(Accelerator(cpu=True), model, processor, vision_data.blank_image())
    reset_accelerate_state()
    return vision_pass


def gradient(model, loss):
    """The loss's gradient; zeros for a parameter it does not reach (LLaVA reads its tower's last hidden
    states: the tower's post-layernorm is never used)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, parameters, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(parameters, grads)])


@pytest.mark.parametrize("arch", ["idefics3", "qwen2_vl", "llava"])
def test_the_accumulated_update_is_the_full_batch_one(request, tmp_path, arch):
    """8 rows of 0, 1 and 2 images: Σ over 4 micro-batches of (loss sum / the window's answer tokens)
    equals the full batch's gradient; a micro-batch with no image adds the zero-weighted vision pass.
    The controls: a mean of micro-batch means, and a count that includes image tokens, are far off."""
    model_dir, processor = request.getfixturevalue(arch)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    rows = tokenized(processor, model_dir, conversations(tmp_path, 8, 8, image_counts=(2, 0, 0, 0, 1, 2, 1, 0))).rows
    collate = vision_data.collate_vision_chats(processor, processor.tokenizer.pad_token_id)
    loss_fn = OutputLoss(model, shift=True)
    image_ids = torch.tensor(sorted(vision_data.image_token_ids(processor, model.config)))
    vision_pass = blank_vision_pass(model, processor)

    def loss_sum(batch):
        vision_pass.arm(batch)
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", *vision_data.model_image_keys(batch))}
        return loss_fn(model, batch["labels"], **inputs)[0]

    full = collate(rows)
    answers = int((full["labels"][:, 1:] != -100).sum())
    exact = gradient(model, loss_sum(full) / answers)
    micro = [collate(rows[i : i + 2]) for i in range(0, 8, 2)]
    assert any(b["num_images"].sum() == 0 for b in micro) and any(b["num_images"].sum() == 3 for b in micro)
    accumulated = sum(gradient(model, loss_sum(b) / answers) for b in micro)
    assert float((accumulated - exact).norm() / exact.norm()) <= RTOL

    mean_of_means = sum(gradient(model, loss_sum(b) / (b["labels"][:, 1:] != -100).sum() / 4) for b in micro)
    image_tokens = int(torch.isin(full["input_ids"], image_ids).sum())
    counted_images = sum(gradient(model, loss_sum(b) / (answers + image_tokens)) for b in micro)
    assert float((mean_of_means - exact).norm() / exact.norm()) > 1e-2
    assert float((counted_images - exact).norm() / exact.norm()) > 1e-2


def test_the_zero_weighted_vision_pass_adds_exactly_nothing(tmp_path, idefics3):
    """A micro-batch without an image: with the blank image's pass armed, the gradient of every
    parameter is bitwise the one without it, and the vision tower's and connector's are exact zeros
    instead of none (what DDP, FSDP and ZeRO-3 wait for)."""
    model_dir, processor = idefics3
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    rows = tokenized(processor, model_dir, conversations(tmp_path, 2, seed=9, image_counts=(0,))).rows
    batch = vision_data.collate_vision_chats(processor, processor.tokenizer.pad_token_id)(rows)
    vision_pass = blank_vision_pass(model, processor)
    parameters = dict(model.named_parameters())

    def grads(with_pass: bool) -> dict:
        model.zero_grad(set_to_none=True)
        vision_pass.arm(batch) if with_pass else vision_pass.disarm()
        OutputLoss(model, shift=True)(model, batch["labels"], input_ids=batch["input_ids"],
                                      attention_mask=batch["attention_mask"])[0].backward()  # fmt: skip
        return {name: None if p.grad is None else p.grad.clone() for name, p in parameters.items()}

    without, with_pass = grads(False), grads(True)
    vision = [n for n in parameters if ".vision_model." in n or ".connector." in n]
    assert vision and all(without[n] is None for n in vision)
    assert all(with_pass[n] is not None and not with_pass[n].any() for n in vision)
    assert all(torch.equal(with_pass[n], without[n]) for n in parameters if n not in vision)


@pytest.mark.launch
def test_recipe_accumulation_matches_the_full_batch_and_two_ddp_processes(tmp_path, idefics3, vision_files):
    model_dir, _ = idefics3

    def args(out, micro, accumulation):
        return recipe_args(model_dir, vision_files, out, per_device_train_batch_size=micro,
                           gradient_accumulation_steps=accumulation, max_seq_length=128, max_new_tokens=2)  # fmt: skip

    # 13 rows, 2 with images: the second window holds 5 rows, so on 2 processes (2 × 2) process 1's last
    # micro-batch is all Accelerate's repeats; every window has micro-batches without an image.
    # (2 × 4) on one process: the contract check's, on the recipe's own default (tests/test_recipe_contract.py).
    run_in_process("vision_language", args(tmp_path / "full", 8, 1))
    launch("vision_language", args(tmp_path / "ddp", 2, 2), num_processes=2)
    full = final_weights(tmp_path / "full")
    assert relative_error(final_weights(tmp_path / "ddp"), full) <= RTOL
    assert json.loads((tmp_path / "ddp" / "all_results.json").read_text())["num_processes"] == 2
    assert [r["samples_seen"] for r in read_metrics(tmp_path / "ddp")] == [8, 13]

    # final/ is a vision-language model with its processor: it loads and answers about an image.
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "full" / "final")
    processor = AutoProcessor.from_pretrained(tmp_path / "full" / "final")
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[Image.new("RGB", (8, 8), "white")]], return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3


def test_lora_saves_the_connector_with_the_adapter_and_merges(tmp_path, idefics3, vision_files):
    model_dir, _ = idefics3
    run_in_process("vision_language", recipe_args(model_dir, vision_files, tmp_path, max_train_steps=1,
                                                  use_lora=True, lora_r=4, merge_lora=True, max_new_tokens=1))  # fmt: skip
    adapter = final_weights(tmp_path)
    assert any(".connector." in k for k in adapter) and not any(".vision_model." in k for k in adapter)
    assert not any("vision_model" in k and "lora_" in k for k in adapter)  # LoRA on the language model only
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "final_merged")
    assert type(merged).__name__ == "Idefics3ForConditionalGeneration"


def test_lora_under_bf16_mixed_precision_generates_with_its_frozen_parts_in_bf16(
    tmp_path, idefics3, vision_files, monkeypatch, capsys
):
    """As accelerate_configs/single_gpu_bf16.yaml runs it: the frozen language model and tower are
    stored in bf16 beside the fp32 connector and adapters, and the evaluation's generate() runs under
    the training's autocast (unwrap_model drops the prepared forward's): without it the connector is
    fed the tower's bf16 features."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    model_dir, _ = idefics3
    results = run_in_process("vision_language", recipe_args(model_dir, vision_files, tmp_path, max_train_steps=1,
                                                            use_lora=True, lora_r=4, max_new_tokens=1))  # fmt: skip
    assert "frozen bfloat16" in capsys.readouterr().out
    assert 0 <= results["eval_exact_match"] <= 1


@pytest.mark.parametrize(
    "fault, fragment",
    [
        ("missing", "train row 1: image file .*missing.png not found"),
        ("undecodable", "train row 1: an image does not decode"),
        ("mismatch", r"train row 1: 1 image part\(s\) in the messages but 2 image\(s\)"),
        ("assistant_image", "train row 1: an assistant turn holds an image"),
        ("text_model", "not a vision-language model|has no image processor"),
    ],
)
def test_bad_input_is_one_line(tmp_path, idefics3, chat_lm_dir, fault, fragment):
    model_dir, _ = idefics3
    (tmp_path / "bad.png").write_bytes(b"not a png")
    user = [{"type": "image"}, {"type": "text", "text": "Which?"}]
    answer = [{"type": "text", "text": "three"}]
    row = {
        "missing": {"images": ["missing.png"]},
        "undecodable": {"images": ["bad.png"]},
        "mismatch": {"images": ["bad.png", "bad.png"]},
        "assistant_image": {"images": ["bad.png"], "answer": [{"type": "image"}]},
        "text_model": {"images": []},
    }[fault]
    content = user if row["images"] or fault == "mismatch" else user[1:]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": row.get("answer", answer)}]
    data = write_jsonl(tmp_path / "train.jsonl", [{"messages": messages, "images": row["images"]}] * 4)
    model = chat_lm_dir if fault == "text_model" else model_dir
    message = error_of("vision_language", recipe_args(model, {"train": data, "validation": data}, tmp_path / "out"))
    assert __import__("re").search(fragment, message), message
