r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/vision_language.py \
    --config recipes/configs/vision_language.yaml

Fine-tune a vision-language model (SmolVLM, Qwen2-VL/2.5-VL, LLaVA, Gemma 3) on conversations
about images: the loss covers the assistant's text only, and each update is the exact mean over
every answer token in the window, on all processes, whatever the mix of images in each row.

Image tokens are never targets and never counted: an image is tens to thousands of placeholder
tokens, and a loss or a count that includes them (TRL's default vision collator; a model's own
`loss_function` under accumulation, LLaMA-Factory #7443) weights each answer by how many images sit
beside it. Here the labels are the assistant turns' tokens (ft_accum/data/vision_chat_data.py),
each micro-batch's loss is summed over them, and the window divides once by their total.

With no flags it assembles SmolVLM's architecture from the bundled SmolLM2-135M-Instruct and a
small SigLIP vision tower (ft_accum/data/offline_vlm.py; no vision-language weights can be
installed offline), and teaches it to read scikit-learn's handwritten digits: "Which digit is
this?", "Is this digit even or odd?", two-image rows and text-only rows. It reports the held-out
answer-token loss and the exact match of greedy answers before and after. Point it at your data
with --train_file (json, jsonl; image paths relative to the file) or --dataset_name: TRL's vision
format, a `messages` column of turns whose content is a list of {"type": "image"} and
{"type": "text", "text": ...} parts, and an `images` column (a list per row; rows may have none).

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps) in conversations; --max_seq_length
  tokens each, images included (a row is cut only after its last image's tokens, or dropped: counted).
- --use_lora trains LoRA adapters on the language model's linear layers and the connector whole;
  the vision tower stays frozen unless --train_vision_tower. --load_in_4bit is QLoRA (a GPU, [lowmem]).
- A micro-batch without an image still runs the vision tower, on a blank image weighted by 0, so
  that under DDP, FSDP and DeepSpeed no process waits for gradients that never come.

Outputs in --output_dir: final/ (the model and its processor, or the LoRA adapter), final_merged/
(--merge_lora), metrics.jsonl (one line per update), all_results.json, checkpoints/step_XXXXXX/.
SIGTERM or Ctrl-C finishes the current update, saves a checkpoint and prints the resume command.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from accelerate.utils import set_seed
from transformers import AutoModelForImageTextToText, AutoProcessor

from ft_accum.core.errors import ConfigError
from ft_accum.data import data_sources, offline_assets, offline_vlm
from ft_accum.data import vision_chat_data as vision_data
from ft_accum.models import loading, lora, low_memory, vision_language
from ft_accum.models.output_loss import OutputLoss
from ft_accum.training import chat_evaluation, run_outputs, run_setup
from ft_accum.training.arguments import LoraArguments, run_main


@dataclass
class TaskArguments(LoraArguments):
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local dir or hub name. Default: SmolVLM assembled from SmolLM2 (offline)."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (needs network). Default: questions about digits (offline)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(
        default=None, metadata={"help": "Local json or jsonl; image paths relative to it."}
    )
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local file; default: 10%% of train."})
    messages_column: str = field(default="messages", metadata={"help": "Turns of image and text parts."})
    images_column: str = field(default="images", metadata={"help": "A list of images per row (files or Image)."})
    max_seq_length: int = field(default=512, metadata={"help": "Tokens per conversation, image tokens included."})
    train_vision_tower: bool = field(default=False, metadata={"help": "Train the vision tower too (else frozen)."})
    merge_lora: bool = field(default=False, metadata={"help": "Also save the merged model in final_merged/."})
    chunked_loss: bool = field(default=True, metadata={"help": "Loss from the hidden states in chunks (exact)."})
    max_new_tokens: int = field(default=8, metadata={"help": "Generation length for the exact-match score."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("max_seq_length", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be ≥ 1, got {getattr(self, name)}")


NO_DECAY = ("bias", "norm.weight", "layernorm.weight")


def base_model_name(task):
    return task.model_name_or_path or str(offline_vlm.bundled_smolvlm_dir())


def build_model(task, args, accelerator):
    name = base_model_name(task)
    if task.use_lora:
        lora.import_peft()  # a missing peft fails before the model loads
    processor = loading.load_pretrained(AutoProcessor, name, args.trust_remote_code)
    vision_language.check_processor(processor, name)
    model = run_setup.load_causal_lm(
        name,
        args,
        accelerator,
        frozen_base=task.use_lora,
        load_in_4bit=task.load_in_4bit,
        auto_class=AutoModelForImageTextToText,
    )
    vision_language.check_vision_language(model, name)
    processor.tokenizer.padding_side = "right"
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token  # padding is masked out of the loss
    if args.gradient_checkpointing:
        loading.enable_gradient_checkpointing(model)
    if task.use_lora:
        targets = vision_language.lora_targets(model, task.lora_target_modules)
        trained = vision_language.trained_parts(model, task.train_vision_tower)
        model = run_setup.apply_lora(model, task, args, target_modules=targets, modules_to_save=trained)
    elif not task.train_vision_tower:
        vision_language.freeze_vision_tower(model)
    return model, processor


def load_conversations(task, args):
    """{split: [(messages, image sources, their folder), ...]}, every row checked and its images decoded once."""
    raw = run_setup.load_splits(task, seed=args.seed, bundled=lambda seed: offline_assets.load_digit_questions(seed))
    raw = data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)
    files = {"train": task.train_file, "validation": task.validation_file or task.train_file}
    folders = {split: Path(f).resolve().parent if f else None for split, f in files.items()}
    return vision_data.vision_conversations_of(raw, task.messages_column, task.images_column, folders)


def build_dataloaders(task, args, accelerator, conversations, processor, model_config):
    image_ids = vision_data.image_token_ids(processor, model_config)
    with accelerator.main_process_first():
        tokenized = vision_data.tokenize_splits(processor, conversations, task.max_seq_length, image_ids)
    collate = vision_data.collate_vision_chats(processor, processor.tokenizer.pad_token_id)
    train_dataloader, eval_dataloader = data_sources.seeded_dataloaders(
        {"train": tokenized["train"].rows, "validation": tokenized["validation"].rows},
        collate,
        args.per_device_train_batch_size,
        args.per_device_eval_batch_size,
        args.seed,
    )
    return train_dataloader, eval_dataloader, tokenized


def model_inputs(batch):
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", *vision_data.model_image_keys(batch))}
    return {**inputs, "use_cache": False}


def count_items(batch):
    """What the loss is a mean over: answer tokens, counted after the causal shift (the rest are -100)."""
    return (batch["labels"][:, 1:] != -100).sum()


def training_step(model, batch, output_loss, vision_pass):
    """The micro-batch's loss summed over its answer tokens. Without an image, the model's forward
    still runs the vision tower, on a blank image weighted by 0 (`BlankVisionPass`): every process
    calls the same modules (DDP waits for every gradient; FSDP and ZeRO-3 gather in call order)."""
    vision_pass.arm(batch)
    return output_loss(model, batch["labels"], **model_inputs(batch))[0]


def eval_inputs(vision_pass):
    """`model_inputs` for the evaluation's forwards, the blank vision pass armed where a batch has no image."""

    def inputs(batch):
        vision_pass.arm(batch)
        return model_inputs(batch)

    return inputs


def answer_inputs(processor, eval_rows):
    """(items for chat_evaluation.greedy_exact_match, their encoder): each held-out conversation's
    prompt (all but its last turn, with its images) and the last turn's answer. A batch of prompts
    without an image gets a blank-image prompt after them (its answer is dropped), so that every
    process's generate() runs the vision tower."""
    items = []
    for messages, sources, folder in eval_rows:
        parts = messages[-1]["content"]
        answer = parts if isinstance(parts, str) else "".join(p.get("text") or "" for p in parts)
        images = [vision_data.load_image(s, folder, "a validation row") for s in sources]
        items.append(((messages[:-1], images), answer))
    blank = ([{"role": "user", "content": [{"type": "image"}]}], [vision_data.blank_image()])

    def encode(prompts):
        prompts = prompts if any(images for _, images in prompts) else [*prompts, blank]
        texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m, _ in prompts]
        encoded = vision_data.encode(processor, texts, [images for _, images in prompts])
        return {k: v for k, v in encoded.items() if k != "mm_token_type_ids"}

    return items, encode


@torch.no_grad()
def evaluate(task, model, eval_dataloader, accelerator, output_loss, processor, answers, vision_pass):
    """The answer-token loss over the validation set, and the exact match of greedy answers."""
    model.eval()
    loss = output_loss.mean_loss(model, eval_dataloader, accelerator, eval_inputs(vision_pass))
    vision_pass.disarm()  # generate()'s prompts carry a blank image themselves where they have none
    items, encode = answers
    exact = chat_evaluation.greedy_exact_match(
        accelerator, model, processor.tokenizer, items, encode, max_new_tokens=task.max_new_tokens
    )
    model.train()
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50)), "eval_exact_match": exact}


def describe_data(task, model, tokenized, effective_batch_size: int, loss_path: str):
    """For the banner: which parts train, the images and their tokens, the loss's denominator, truncation."""
    train = tokenized["train"]
    rows = len(train.rows)
    answers = sum(sum(label != -100 for label in row["labels"]) for row in train.rows) / rows
    trained = "LoRA on the language model, " if task.use_lora else "the language model, "
    trained += (
        "the vision tower and the connector" if task.train_vision_tower else "the connector (vision tower frozen)"
    )
    return {
        "trainable": f"{lora.describe_trainable(model, task.lora_r if task.use_lora else None)}: {trained}",
        "conversations": f"{rows} train / {len(tokenized['validation'].rows)} eval",
        "images": f"≈{train.images / rows * effective_batch_size:.1f} per update, "
        f"{train.image_tokens / max(train.images, 1):.0f} tokens each (never targets)",
        "answer tokens": f"≈{answers * effective_batch_size:,.0f} per update (the loss's denominator)",
        "truncated": f"{train.truncated} train conversations cut after their images to {task.max_seq_length} tokens, "
        f"{train.dropped} dropped (the cut fell inside an image, or left no answer)",
        "loss": loss_path,
    }


def save_extras(task, accelerator, model, processor, output_dir) -> dict:
    """--merge_lora: the base with the adapter merged into final_merged/."""
    if not (task.use_lora and task.merge_lora):
        return {}
    return run_outputs.save_merged_lora(
        accelerator, model, processor, output_dir, base_name=base_model_name(task), base_in_4bit=task.load_in_4bit
    )


def train(task, args):
    accelerator, plan = run_setup.build_accelerator(task, args, "vision_language", loss_weighted_by="tokens")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    conversations = load_conversations(task, args)
    with accelerator.main_process_first():  # the first run assembles the default model once, on one process
        model, processor = build_model(task, args, accelerator)
    train_dataloader, eval_dataloader, tokenized = build_dataloaders(
        task, args, accelerator, conversations, processor, model.config
    )
    run_setup.fit_fsdp_units(accelerator, model)  # under FSDP: which modules shard together
    optimizer = run_setup.build_optimizer(
        model, args=args, plan=plan, no_decay=NO_DECAY, loraplus_lr_ratio=task.loraplus_lr_ratio
    )
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    output_loss = OutputLoss(
        accelerator.unwrap_model(model), shift=True, accelerator=accelerator, enabled=task.chunked_loss
    )
    vision_pass = vision_language.BlankVisionPass(accelerator, model, processor, vision_data.blank_image())
    train_windows, lr_scheduler, tracker = run_setup.start_training(
        accelerator,
        args,
        plan,
        model=model,
        optimizer=optimizer,
        train_dataloader=train_dataloader,
        count_items=count_items,
        unit="answer tokens",
        sample_unit="conversations",
        banner_rows=describe_data(task, model, tokenized, plan.effective, output_loss.path),
        mean_tokens_per_sample=sum(len(r["input_ids"]) for r in tokenized["train"].rows)
        / len(tokenized["train"].rows),
    )
    answers = answer_inputs(processor, conversations["validation"])
    tracker.evaluate_before_training(
        evaluate, task, model, eval_dataloader, accelerator, output_loss, processor, answers, vision_pass
    )
    model.train()
    for window in train_windows:  # one optimizer update; window.num_items: its answer tokens, on every process
        for batch in window:
            with accelerator.accumulate(model), offload, window.retry_on_out_of_memory():
                loss_sum = training_step(model, batch, output_loss, vision_pass)
                # Σ loss / num_items over the window: scale = N·P / num_items undoes backward's ÷N and DDP's ÷P
                accelerator.backward(loss_sum * window.scale)
                window.add_loss(loss_sum)
                if accelerator.sync_gradients:  # the window's last micro-batch: a NaN loss stops before the step
                    window.check_finite_loss()
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        tracker.end_update(window, grad_norm=grad_norm)
        if window.evaluation_due:  # an epoch's end, or every --eval_steps updates
            tracker.evaluate(
                evaluate, task, model, eval_dataloader, accelerator, output_loss, processor, answers, vision_pass
            )
    train_chats = tokenized["train"]
    counts = {
        "truncated_train_conversations": train_chats.truncated,
        "dropped_train_conversations": train_chats.dropped,
    }
    extras = lambda: save_extras(task, accelerator, model, processor, args.output_dir)  # noqa: E731
    return tracker.finish(model, tokenizer=processor, after_save=extras, **counts)


def main(argv=None):
    return run_main(
        train,
        TaskArguments,
        argv,
        __doc__,
        output_dir="outputs/vision_language",
        metric_for_best_model="eval_loss",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=2e-4,
        weight_decay=0.0,
        num_train_epochs=1,
    )


if __name__ == "__main__":
    main()
