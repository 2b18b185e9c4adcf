r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/contrastive_embedding.py \
    --config recipes/configs/contrastive_embedding.yaml

Fine-tune a sentence-embedding (retrieval) model with in-batch negatives, exact over the effective batch.

An in-batch-negatives loss (MultipleNegativesRankingLoss / InfoNCE) scores every anchor against every
positive of the update: the batch size *is* the number of negatives. Ordinary gradient accumulation
gives each micro-batch only its own negatives, a different loss (about half the gradient off). This
recipe uses GradCache (Gao et al. 2021): the update's pairs are embedded without a graph, the loss over
all of them (every process's) gives the gradient of each embedding, and each micro-batch is embedded
again with its own dropout masks and backpropagated with that gradient: the large batch's update at
one micro-batch's memory, for one more forward of each micro-batch.

With no flags it fine-tunes the bundled all-MiniLM-L6-v2 (mean pooling, normalised) on BBC News,
each article's headline as the anchor and its opening sentence as the positive, and reports
retrieval over the 445 held-out articles (headline → opening): Recall@1, MRR@10, nDCG@10, before and after.
Your own data: --train_file/--validation_file (csv, tsv, json, jsonl) or --dataset_name, with columns
`anchor`, `positive` and optionally `negative` (a hard negative: sentence-transformers' convention).

The settings that matter:
- --effective_batch_size: the pairs of one update, so 2 × effective − 1 candidates per anchor with
  hard negatives, effective − 1 without; --per_device_train_batch_size only sets memory.
- --scale (sentence-transformers' 20: 1 / temperature) and --symmetric (CLIP's two-way loss).
- --learning_rate is right at --base_batch_size; --lr_scaling adapts it to the effective batch.

Outputs in --output_dir: final/ (save_pretrained and sentence-transformers' module files: it loads with
`SentenceTransformer("final")`), metrics.jsonl, all_results.json, checkpoints/ (--checkpointing_steps).
SIGTERM or Ctrl-C finishes the current update, saves a checkpoint and prints the resume command.
"""

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate.utils import set_seed
from transformers import AutoModel, AutoTokenizer

from ft_accum.core import contrastive_loss, retrieval_metrics
from ft_accum.core.errors import ConfigError
from ft_accum.data import data_sources, offline_assets
from ft_accum.data.text_columns import PadEachColumn, tokenize_columns
from ft_accum.models import loading, low_memory, sentence_embedding
from ft_accum.training import run_setup
from ft_accum.training.arguments import run_main
from ft_accum.training.embedding_cache import EmbeddingCache


@dataclass
class TaskArguments:
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local dir or hub name. Default: the bundled all-MiniLM-L6-v2 (offline)."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (needs network). Default: BBC News headline/opening pairs."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local csv, tsv, json or jsonl training rows."})
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Local evaluation pairs (the retrieval test); default: 10%% of train."}
    )
    anchor_column: str = field(default="anchor", metadata={"help": "Column holding the anchor (the query)."})
    positive_column: str = field(default="positive", metadata={"help": "Column holding the anchor's positive."})
    negative_column: str = field(
        default="negative", metadata={"help": "Column holding a hard negative; used when the data has it."}
    )
    max_seq_length: int = field(default=128, metadata={"help": "Truncate each text to this many tokens."})
    scale: float = field(
        default=contrastive_loss.DEFAULT_SCALE, metadata={"help": "Similarity scale, 1 / temperature (> 0)."}
    )
    symmetric: bool = field(default=False, metadata={"help": "Also score each positive against the anchors (CLIP)."})

    def __post_init__(self):
        contrastive_loss.check_scale(self.scale)
        if self.max_seq_length < 2:
            raise ConfigError(f"--max_seq_length must be ≥ 2, got {self.max_seq_length} (room for [CLS] and [SEP])")


NO_DECAY = ("bias", "LayerNorm.weight", "layer_norm.weight")


def load_raw_data(task, args):
    raw = run_setup.load_splits(task, seed=args.seed, bundled=offline_assets.load_bbc_retrieval_pairs)
    has_negatives = all(task.negative_column in split.column_names for split in raw.values())
    columns = {"anchor_column": task.anchor_column, "positive_column": task.positive_column}
    if has_negatives:
        columns["negative_column"] = task.negative_column
    raw = data_sources.check_columns(raw, **columns)
    for flag, name in columns.items():
        data_sources.check_text_column(raw, name, flag=f"--{flag}")
    data_sources.check_no_empty_text(raw, *columns.values())
    renamed = {name: flag.removesuffix("_column") for flag, name in columns.items()}
    raw = raw.rename_columns({old: new for old, new in renamed.items() if old != new})
    return data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)


def build_model(task, args):
    name = task.model_name_or_path or str(offline_assets.bundled_minilm_dir())
    tokenizer = loading.load_pretrained(AutoTokenizer, name, args.trust_remote_code)
    model = loading.load_pretrained(AutoModel, name, args.trust_remote_code)
    if (
        getattr(model, "pooler", None) is not None
    ):  # unused by a mean-pooled embedding: DDP would wait for its gradient
        model.pooler = None
    model = loading.cast_and_compile(model, args.model_dtype, args.torch_compile)
    loading.check_context_length(model.config, task.max_seq_length, "--max_seq_length")
    if args.gradient_checkpointing:
        loading.enable_gradient_checkpointing(model)
    return model, tokenizer


def build_dataloaders(task, args, accelerator, raw, tokenizer):
    columns = raw["train"].column_names
    with accelerator.main_process_first():
        tokenized = raw.map(
            lambda rows: tokenize_columns(tokenizer, rows, columns, task.max_seq_length),
            batched=True,
            remove_columns=columns,
            desc="Tokenizing",
        )
    collator = PadEachColumn(tokenizer, columns, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None)
    train_dataloader, eval_dataloader = data_sources.seeded_dataloaders(
        tokenized, collator, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed
    )
    mean_tokens = sum(len(ids) for c in columns for ids in tokenized["train"][f"{c}_input_ids"]) / len(raw["train"])
    return train_dataloader, eval_dataloader, mean_tokens


def count_items(batch):
    """What the loss is a mean over: the micro-batch's anchors (the window sums them before any forward)."""
    return len(batch["anchor_input_ids"])


def embed(model, batch):
    """The micro-batch's columns (anchor, positive[, negative]) as unit-length mean-pooled embeddings."""
    columns = [c for c in ("anchor", "positive", "negative") if f"{c}_input_ids" in batch]
    return tuple(
        sentence_embedding.sentence_embeddings(model, batch[f"{c}_input_ids"], batch[f"{c}_attention_mask"])
        for c in columns
    )


def evaluate_model(model, eval_dataloader, accelerator):
    """Retrieval over the held-out pairs: each anchor the query, every held-out positive a document."""
    model.eval()
    queries, documents = [], []
    for batch in eval_dataloader:
        with torch.no_grad():
            anchors, positives = embed(model, batch)[:2]
        # gather_for_metrics drops the rows Accelerate repeated to even out the last batch.
        anchors, positives = accelerator.gather_for_metrics((anchors.float(), positives.float()))
        queries.append(anchors)
        documents.append(positives)
    model.train()
    ranks = retrieval_metrics.positive_ranks(torch.cat(queries) @ torch.cat(documents).T)
    return {f"eval_{name}": value for name, value in retrieval_metrics.retrieval_metrics(ranks, k=10).items()}


def train(task, args):
    for flag in ("auto_micro_batch", "measure_noise_scale"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag}: the contrastive recipe caches a whole update's embeddings; drop the flag")
    accelerator, plan = run_setup.build_accelerator(task, args, "contrastive_embedding")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    raw = load_raw_data(task, args)
    hard_negatives = "negative" in raw["train"].column_names
    contrastive_loss.check_negatives(plan.effective, hard_negatives)
    model, tokenizer = build_model(task, args)
    loading.check_tokenizer(
        tokenizer, model, task.model_name_or_path or "the bundled model", raw["train"][:64]["anchor"]
    )
    train_dataloader, eval_dataloader, mean_tokens = build_dataloaders(task, args, accelerator, raw, tokenizer)
    run_setup.fit_fsdp_units(accelerator, model)  # under FSDP: which modules shard together
    optimizer = run_setup.build_optimizer(model, args=args, plan=plan, no_decay=NO_DECAY)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    negatives = contrastive_loss.negatives_per_anchor(plan.effective, hard_negatives)
    which = "the update's other positives" + (" and every hard negative" if hard_negatives else "")
    rows = {
        "train / eval pairs": f"{len(raw['train'])} / {len(raw['validation'])}",
        "negatives per anchor": f"{negatives} ({which})",
    }
    train_windows, lr_scheduler, tracker = run_setup.start_training(
        accelerator,
        args,
        plan,
        model=model,
        optimizer=optimizer,
        train_dataloader=train_dataloader,
        count_items=count_items,
        unit="pairs",
        sample_unit="pairs",
        banner_rows=rows,
        mean_tokens_per_sample=mean_tokens,
    )
    tracker.evaluate_before_training(evaluate_model, model, eval_dataloader, accelerator)
    losses = functools.partial(contrastive_loss.contrastive_losses, scale=task.scale, symmetric=task.symmetric)
    cache = EmbeddingCache(accelerator, lambda batch: embed(model, batch), losses)
    model.train()
    for window in train_windows:  # one optimizer update; window.num_items: its pairs, on every process
        # Every pair of the update embedded without a graph: the update's loss and each embedding's gradient.
        cache.first_pass(window.micro_batches, window.real)
        for batch in window:
            with accelerator.accumulate(model), offload:
                # Embedded again with the same dropout masks; backward adds this micro-batch's share of ∇loss.
                loss_sum, surrogate = cache.replay(batch)
                # Σ loss / num_items over the update: scale = N·P / num_items undoes backward's ÷N and DDP's ÷P
                accelerator.backward(surrogate * window.scale)
                window.add_loss(loss_sum)
                if accelerator.sync_gradients:  # the window's last micro-batch: a NaN loss stops before the step
                    window.check_finite_loss()
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        tracker.end_update(window, grad_norm=grad_norm)
        if window.evaluation_due:  # an epoch's end, or every --eval_steps updates
            tracker.evaluate(evaluate_model, model, eval_dataloader, accelerator)
    hidden_size = accelerator.unwrap_model(model).config.hidden_size
    final_files = sentence_embedding.sentence_transformers_files(hidden_size, task.max_seq_length)
    return tracker.finish(model, tokenizer=tokenizer, final_files=final_files)


def main(argv=None):
    return run_main(
        train,
        TaskArguments,
        argv,
        __doc__,
        output_dir="outputs/contrastive_embedding",
        metric_for_best_model="eval_mrr@10",
    )


if __name__ == "__main__":
    main()
