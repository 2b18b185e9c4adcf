"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/seq2seq.py --config recipes/configs/seq2seq.yaml

Fine-tune a sequence-to-sequence model (summarisation, translation, headlines) with exact,
target-token-weighted accumulation.

With no flags it warm-starts an encoder-decoder from the pretrained all-MiniLM-L6-v2 (Rothe et
al. 2020, arXiv:1907.12461: encoder and decoder both initialised from it, cross-attention new)
and trains it to write BBC News headlines from the article (both carried by PyPI packages:
nothing is downloaded). T5/BART-style models work unchanged with --model_name_or_path.

The loss is a mean over *target tokens*: the window's total count over all micro-batches and
processes divides the summed loss, so short and long targets weigh as in one large batch.

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps), in examples;
- --max_source_length, --max_target_length, and --num_beams for the evaluation's generation;
- precision and processes come from the Accelerate config (accelerate_configs/), not from here.

Outputs in --output_dir: final/ (save_pretrained), metrics.jsonl, all_results.json (ROUGE before
and after training), checkpoints/step_XXXXXX/ (with --checkpointing_steps).
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
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq

from ft_accum import batch_arithmetic, checkpointing
from ft_accum.accumulation_schedule import apply_effective_batch, check_schedule, next_effective_batch, parse_accumulation_schedule, plan_windows, scheduler_advance
from ft_accum.arguments import parse_config, require_at_least
from ft_accum.banner import format_banner
from ft_accum.data_sources import check_columns, check_text_column, drop_empty_rows, load_hub_dataset, load_local_files, seeded_dataloaders, take_first_rows, with_validation_split
from ft_accum.errors import ConfigError
from ft_accum.memory import is_out_of_memory, peak_memory_gb, retry_with_smaller_micro_batch
from ft_accum.loading import check_context_length, freeze_encoder_pooler, load_pretrained, warm_start_encoder_decoder
from ft_accum.loss_normalization import check_finite_window, check_skipped_updates, scale_gradients_, window_gradient_scale
from ft_accum.lr_scaling import POLICIES, describe_lr_scaling, scale_learning_rate
from ft_accum.lr_schedule import build_lr_scheduler
from ft_accum.metrics import load_metric
from ft_accum.noise_scale import add_micro_batch, advise_effective_batch, noise_scale, start_noise_scale_measurement, update_ema, window_noise_terms
from ft_accum.offline_assets import bundled_minilm_dir, load_bbc_headlines
from ft_accum.run_outputs import append_metrics, check_accelerator, prepare_output_dir, resolve_report_to, save_final, truncate_metrics



@dataclass
class TrainConfig:
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "A seq2seq model (T5, BART, …; local dir or hub name), or an encoder to warm-start an encoder-decoder from. Default: the bundled all-MiniLM-L6-v2, warm-started (offline)."})
    dataset_name: Optional[str] = field(default=None, metadata={"help": "Hub dataset, e.g. xsum (needs network). Default: BBC News articles → their headlines (offline)."})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local csv, tsv, json or jsonl with a source and a target column."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local file for evaluation; default: 10%% of train."})
    source_column: str = field(default="source", metadata={"help": "Column holding the input text."})
    target_column: str = field(default="target", metadata={"help": "Column holding the text to generate."})
    source_prefix: str = field(default="", metadata={"help": "Prepended to every source, e.g. 'summarize: ' for T5."})
    max_source_length: int = field(default=256, metadata={"help": "Truncate sources to this many tokens."})
    max_target_length: int = field(default=32, metadata={"help": "Truncate targets to this many tokens; also the generation limit."})
    num_beams: int = field(default=1, metadata={"help": "Beam width of the evaluation's generation (1 = greedy)."})
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
    output_dir: str = field(default="outputs/seq2seq", metadata={"help": "Where final/, checkpoints/ and metrics go."})
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
        require_at_least(self, 2, "max_source_length", "max_target_length")
        require_at_least(self, 1, "num_beams")
        if self.optim not in ("adamw_torch", "sgd"):
            raise ConfigError(f"--optim must be adamw_torch or sgd, got {self.optim!r}")
        if self.lr_scaling not in POLICIES:
            raise ConfigError(f"--lr_scaling must be one of {', '.join(POLICIES)}, got {self.lr_scaling!r}")
        schedule = parse_accumulation_schedule(self.accumulation_schedule)
        self.measure_noise_scale |= bool(schedule and schedule.unit == "adaptive")
        if self.train_file and self.dataset_name:
            raise ConfigError("give --train_file or --dataset_name, not both")


def build_model(cfg):
    name = cfg.model_name_or_path or str(bundled_minilm_dir())
    tokenizer = load_pretrained(AutoTokenizer, name, cfg.trust_remote_code)
    config = load_pretrained(AutoConfig, name, cfg.trust_remote_code)
    if config.is_encoder_decoder:
        model = freeze_encoder_pooler(load_pretrained(AutoModelForSeq2SeqLM, name, cfg.trust_remote_code))  # e.g. a saved bert2bert
    else:  # an encoder-only checkpoint: warm-start both halves from it (Rothe et al. 2020)
        model = warm_start_encoder_decoder(name, tokenizer)
    check_context_length(getattr(model.config, "encoder", model.config), cfg.max_source_length, "--max_source_length")
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
        raw = load_bbc_headlines(seed=cfg.seed)
    raw = with_validation_split(raw, cfg.seed)
    check_columns(raw, source_column=cfg.source_column, target_column=cfg.target_column)
    raw = drop_empty_rows(raw, cfg.source_column, cfg.target_column)
    check_text_column(raw, cfg.source_column)
    check_text_column(raw, cfg.target_column)
    return take_first_rows(raw, train=cfg.max_train_samples, validation=cfg.max_eval_samples)


def build_dataloaders(cfg, accelerator, raw, tokenizer, model):
    def tokenize(rows):
        encoded = tokenizer([cfg.source_prefix + text for text in rows[cfg.source_column]], truncation=True, max_length=cfg.max_source_length)
        encoded["labels"] = tokenizer(text_target=rows[cfg.target_column], truncation=True, max_length=cfg.max_target_length)["input_ids"]
        return encoded

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")
    # Pads labels with -100 (skipped by the loss) and builds decoder_input_ids by shifting them right.
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None)
    # Generators of their own keep dropout bit-identical across a resume (see seeded_dataloaders).
    train_dataloader, eval_dataloader = seeded_dataloaders(tokenized, collator, cfg.per_device_train_batch_size, cfg.per_device_eval_batch_size, cfg.seed)
    mean_tokens = sum(map(len, tokenized["train"]["labels"])) / len(tokenized["train"])
    return train_dataloader, eval_dataloader, mean_tokens


def target_loss_sum(logits, labels):
    """(Σ cross-entropy over target tokens, their count): logits[t] predicts labels[t]; -100 marks padding."""
    loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, (labels != -100).sum()


def evaluate_model(cfg, model, eval_dataloader, accelerator, tokenizer, rouge):
    """Teacher-forced loss over target tokens, then ROUGE of generated outputs against the references."""
    model.eval()
    loss_sum, count, predictions, references = 0.0, 0, [], []
    for batch in tqdm(eval_dataloader, desc="evaluating", leave=False, disable=not accelerator.is_local_main_process):
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits.float()
            generated = accelerator.unwrap_model(model).generate(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], num_beams=cfg.num_beams, max_new_tokens=cfg.max_target_length)
        row_losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none").sum(1)
        # Pad to one length before gathering: processes generate and pad to different lengths. gather_for_metrics
        # drops the rows Accelerate repeated to even out the last batch.
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
        labels = accelerator.pad_across_processes(labels, dim=1, pad_index=-100)
        generated, labels, row_losses = accelerator.gather_for_metrics((generated, labels, row_losses))
        loss_sum, count = loss_sum + row_losses.sum().item(), count + int((labels != -100).sum())
        predictions += tokenizer.batch_decode(generated, skip_special_tokens=True)
        references += tokenizer.batch_decode(labels.masked_fill(labels == -100, tokenizer.pad_token_id), skip_special_tokens=True)
    model.train()
    scores = rouge.compute(predictions=predictions, references=references)
    return {"eval_loss": loss_sum / count, **{f"eval_{kind}": score for kind, score in scores.items()}, "eval_example": predictions[0]}


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

    raw = load_raw_data(cfg)
    model, tokenizer = build_model(cfg)
    train_dataloader, eval_dataloader, mean_tokens = build_dataloaders(cfg, accelerator, raw, tokenizer, model)
    nominal_tokens = cfg.per_device_train_batch_size * cfg.max_target_length  # any constant works; this keeps losses O(1)

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
        mean_tokens_per_sample=mean_tokens, extra={"train / eval rows": f"{len(raw['train'])} / {len(raw['validation'])}", "model": type(model).__name__,
                                                   **({"trust_remote_code": "ON: the model's own Python code ran"} if cfg.trust_remote_code else {}),
               **({"auto micro-batch": "on: out of memory halves the micro-batch, doubles the accumulation"} if cfg.auto_micro_batch else {}),
               **({"accumulation schedule": f"{cfg.accumulation_schedule} (LR scaling re-applied at each change)"} if schedule else {})},
    ))
    if report_to:
        accelerator.init_trackers("seq2seq", config={k: v for k, v in asdict(cfg).items() if isinstance(v, (int, float, str, bool))})

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

    rouge = load_metric("rouge")
    initial_eval = evaluate_model(cfg, model, eval_dataloader, accelerator, tokenizer, rouge)
    accelerator.print(f"before training: eval_rougeL {initial_eval['eval_rougeL']:.4f}, eval_loss {initial_eval['eval_loss']:.4f}")
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
        window = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # summed loss, target tokens, examples
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
                    # A sum over target tokens, not a mean: the window's true count divides it at the sync step.
                    loss_sum, num_tokens = target_loss_sum(logits, labels)
                    window[0] += loss_sum.detach()
                    micro_losses.append(loss_sum.detach())
                    window[1] += num_tokens
                    window[2] += len(labels)
                    accelerator.backward(loss_sum / nominal_tokens)
                    if cfg.measure_noise_scale:  # in target tokens: the hooks saw its mean gradient × tokens/(nominal·N)·scale
                        loss_scale = accelerator.scaler.get_scale() if accelerator.scaler else 1.0
                        add_micro_batch(noise_sums, micro_grad_sq, float(num_tokens) / (nominal_tokens * accumulation) * loss_scale, float(num_tokens))
                    if accelerator.sync_gradients:
                        loss_total, tokens, samples = accelerator.reduce(window, reduction="sum").tolist()
                        if accelerator.mixed_precision != "fp16":  # fp16 overflow is the grad scaler's to skip, and counted below
                            check_finite_window(loss_total, torch.stack(micro_losses).tolist(), state["step"] + 1, accelerator.process_index, last_checkpoint)
                        # Undo backward's /N and DDP's /P and divide by the window's target tokens (see loss_normalization).
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
        eval_metrics = evaluate_model(cfg, model, eval_dataloader, accelerator, tokenizer, rouge)
        started += time.perf_counter() - eval_start  # the throughput figure covers training only
        window_started = time.perf_counter()
        accelerator.print(f"epoch {epoch}: " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items() if k != "eval_example"))
        accelerator.print(f"  e.g. {eval_metrics['eval_example']!r}")
        accelerator.log({k: v for k, v in eval_metrics.items() if k != "eval_example"}, step=state["step"])
        if state["scheduler_steps"] >= num_update_steps:
            break
        epoch += 1
        state.update(epoch=epoch, epoch_samples=0)
    progress.close()
    train_seconds = time.perf_counter() - started
    if cfg.measure_noise_scale and state["noise_scale_ema"]:
        accelerator.print(advise_effective_batch(noise_scale(state["noise_scale_ema"]), round(state["tokens_seen"] / state["step"]), "target tokens"))

    save_final(accelerator, model, tokenizer, output_dir)
    results = {**eval_metrics, **{f"initial_{k}": v for k, v in initial_eval.items()}, "train_runtime": train_seconds, "train_samples_per_second": state["samples_seen"] / train_seconds,
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
