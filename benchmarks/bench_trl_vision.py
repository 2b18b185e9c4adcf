"""Vision-language fine-tuning against TRL's SFTTrainer: how far each toolkit's update is from the
answer-only full-batch update, at each split (issue 63).

    pip install trl==1.16.0          # a benchmark dependency only ([bench] extra), never a runtime one
    python benchmarks/bench_trl_vision.py [--output benchmarks/results/trl_vision.json]

The same tiny Idefics3 (SmolVLM's layout, `ft_accum.testing.make_tiny_idefics3`: SmolLM2's tokenizer,
2 layers of 32, a 2-layer SigLIP tower, 7 tokens per 16 px image), the same 8 conversations with
0, 1 or 2 images and answers of 1 to 25 words, fp32 on the CPU, SGD (LR 0.5, constant, no
clipping), everything trained (ours with --train_vision_tower), one update.

The reference is the answer-only objective written out in plain PyTorch: the model's full logits
over the 8 rows, the cross-entropy summed over the assistant answers' tokens (end-of-turn
included) and divided by their number; the update is −LR × its gradient. Each run's figure is
‖Δθ − Δθ_ref‖ / ‖Δθ_ref‖ over the parameters both save.

TRL in three modes: its default (the `messages` as they are: the vision collator masks padding
only); `assistant_only_loss=True` (a ChatML template with `{% generation %}` markers, which TRL
needs for it); and the prompt-completion form (`completion_only_loss`). Ours: the recipe, which
computes the answer-only labels itself. The rows are in one fixed order for both (TRL's sampler
made sequential; ours seeded), with a micro-batch that has no image at (2 × 4) and one whose first
row has no image and a later one has. A mode TRL cannot collate is reported with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ft_accum.testing import (  # noqa: E402
    make_tiny_chat_lm,
    make_tiny_idefics3,
    reset_accelerate_state,
    run_in_process,
    write_vision_conversations,
)

LEARNING_RATE = 0.5
SPLITS = [(8, 1), (2, 4), (4, 2)]
# Rows 2-3 have no image (a micro-batch without one at 2 × 4); row 4 has none and row 5 has one (a
# micro-batch whose first row has no image and a later one has, at 2 × 4 and 4 × 2).
IMAGE_COUNTS = (2, 1, 0, 0, 0, 2, 1, 0)
GENERATION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}<|im_end|>\n{% endgeneration %}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def load_rows(data_file: Path) -> list[dict]:
    from PIL import Image

    rows = [json.loads(line) for line in data_file.read_text().splitlines()]
    for row in rows:
        row["images"] = [Image.open(data_file.parent / p).convert("RGB") for p in row["images"]]
        for turn in row["messages"]:
            turn["content"] = [{k: v for k, v in part.items() if v is not None} for part in turn["content"]]
    return rows


def state(model) -> dict:
    return {k: v.detach().double().clone() for k, v in model.state_dict().items()}


def relative(delta: dict, reference: dict) -> float:
    keys = sorted(set(delta) & set(reference))
    a = torch.cat([delta[k].flatten() for k in keys])
    b = torch.cat([reference[k].flatten() for k in keys])
    return float((a - b).norm() / b.norm())


def reference_update(model_dir: Path, rows: list[dict]) -> dict:
    """−LR × the gradient of Σ answer-token cross-entropy / their number over the 8 rows, in plain PyTorch."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    total, count = 0.0, 0
    for row in rows:  # one row at a time: no padding, no batch effects
        messages = row["messages"]
        prompt = processor.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        answer = "".join(p["text"] for p in messages[-1]["content"]) + "<|im_end|>\n"
        kwargs = {"images": [row["images"]]} if row["images"] else {}
        prompt_ids = processor(text=[prompt], return_tensors="pt", **kwargs)["input_ids"]
        inputs = processor(text=[prompt + answer], return_tensors="pt", **kwargs)
        logits = model(**inputs).logits[0, :-1]
        targets = inputs["input_ids"][0, 1:].clone()
        targets[: prompt_ids.shape[1] - 1] = -100
        total = total + torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
    parameters = dict(model.named_parameters())
    grads = torch.autograd.grad(total / count, list(parameters.values()), allow_unused=True)
    return {k: -LEARNING_RATE * (torch.zeros_like(p) if g is None else g).double()
            for (k, p), g in zip(parameters.items(), grads)}  # fmt: skip


def trl_update(mode: str, model_dir: Path, rows: list[dict], micro: int, accumulation: int, work: Path):
    """(Δθ, seconds per update) of TRL's SFTTrainer in `mode`, or (None, the error's first line)."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    processor = AutoProcessor.from_pretrained(model_dir)
    if mode == "assistant_only":
        processor.chat_template = GENERATION_TEMPLATE
    if mode == "prompt_completion":
        data = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:], "images": r["images"]} for r in rows]
    else:
        data = [{"messages": r["messages"], "images": r["images"]} for r in rows]
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    before = state(model)
    config = SFTConfig(
        output_dir=str(work / f"trl-{mode}-{micro}x{accumulation}"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, learning_rate=LEARNING_RATE, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=1e9, num_train_epochs=1, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, bf16=False, max_length=None,
        assistant_only_loss=mode == "assistant_only", dataset_kwargs={"skip_prepare_dataset": False},
    )  # fmt: skip
    try:
        trainer = SFTTrainer(
            model=model, args=config, train_dataset=Dataset.from_list(data), processing_class=processor
        )
        trainer._get_train_sampler = lambda *args, **kwargs: SequentialSampler(trainer.train_dataset)
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    except Exception as exc:  # what TRL raises is the finding
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    finally:
        reset_accelerate_state()
    after = state(model)
    return {k: after[k] - before[k] for k in before}, seconds


def our_update(model_dir: Path, data_file: Path, micro: int, accumulation: int, work: Path):
    """(Δθ, seconds per update) of recipes/vision_language.py."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    before = state(AutoModelForImageTextToText.from_pretrained(model_dir))
    out = work / f"ours-{micro}x{accumulation}"
    run_in_process(
        "vision_language",
        [f"--model_name_or_path={model_dir}", f"--train_file={data_file}", f"--validation_file={data_file}",
         f"--output_dir={out}", f"--per_device_train_batch_size={micro}", f"--gradient_accumulation_steps={accumulation}",
         "--max_train_samples=8", "--max_eval_samples=2", "--optim=sgd", f"--learning_rate={LEARNING_RATE}",
         "--lr_scheduler_type=constant", "--max_grad_norm=0", "--num_warmup_steps=0", "--weight_decay=0",
         "--lr_scaling=none", "--num_train_epochs=1", "--max_seq_length=512", "--seed=0", "--report_to=none",
         "--config=none", "--train_vision_tower", "--max_new_tokens=1", "--no_chunked_loss"],
    )  # fmt: skip
    weights = load_file(str(out / "final" / "model.safetensors"))
    results = json.loads((out / "all_results.json").read_text())
    return {k: weights[k].double() - before[k] for k in weights if k in before}, results["train_runtime"]


def label_census(model_dir: Path, rows: list[dict]) -> dict:
    """What TRL's default labels hold in the 8 rows: answers, image placeholders, image markers, the rest."""
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    processor = AutoProcessor.from_pretrained(model_dir)
    batch = DataCollatorForVisionLanguageModeling(processor)(
        [{"messages": r["messages"], "images": r["images"]} for r in rows]
    )
    labels = batch["labels"][:, 1:]
    targets = labels[labels != -100]
    markers = {processor.tokenizer.convert_tokens_to_ids(t) for t in ("<fake_token_around_image>", "<global-img>")}
    answers = sum(
        len(
            processor.tokenizer("".join(p["text"] for p in r["messages"][-1]["content"]) + "<|im_end|>\n")["input_ids"]
        )
        for r in rows
    )
    image = int((targets == processor.image_token_id).sum())
    marker = int(sum((targets == m).sum() for m in markers))
    return {"targets": int(targets.numel()), "answer_tokens": answers, "image_placeholders": image,
            "image_markers": marker, "prompt_and_template": int(targets.numel()) - answers - image - marker}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "trl_vision.json")
    options = parser.parse_args(argv)
    import trl

    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="bench-trl-vision-"))
    model_dir = make_tiny_idefics3(work / "model", make_tiny_chat_lm(work / "chat"))
    data_file = write_vision_conversations(work / "data", 8, seed=5, image_counts=IMAGE_COUNTS)
    rows = load_rows(data_file)
    reference = reference_update(model_dir, rows)
    results = {"trl_version": trl.__version__, "learning_rate": LEARNING_RATE, "image_counts": IMAGE_COUNTS,
               "trl_default_labels": label_census(model_dir, rows), "runs": []}  # fmt: skip
    for micro, accumulation in SPLITS:
        for toolkit, mode in [("trl", "default"), ("trl", "assistant_only"), ("trl", "prompt_completion"),
                              ("ft_accum", "answer tokens")]:  # fmt: skip
            if toolkit == "trl":
                delta, seconds = trl_update(mode, model_dir, rows, micro, accumulation, work)
            else:
                delta, seconds = our_update(model_dir, data_file, micro, accumulation, work)
            row = {"toolkit": toolkit, "mode": mode, "split": f"{micro} × {accumulation}"}
            if delta is None:
                row["error"] = seconds
            else:
                row |= {"relative_error": relative(delta, reference), "seconds_per_update": seconds}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
