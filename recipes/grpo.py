r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/grpo.py \
    --config recipes/configs/grpo.yaml

Online RL with verifiable rewards: GRPO, DAPO, Dr. GRPO and GSPO, with exact accumulation.

Each round samples G completions of each of its prompts, scores them with the reward functions
and turns the scores into group advantages; then it runs the round's updates, each accumulated
over micro-batches of completions and divided by its own count (completions, or completion tokens
for dapo) over all micro-batches and processes: the update of one large batch, whatever the split
(ft_accum/core/grpo_loss.py has the formulas and sources). The completions do not depend on the
split either: --generation_prompts_per_call prompts are sampled at once, seeded by (seed, round, group).

With no flags it LoRA-tunes the bundled SmolLM2-135M-Instruct on generated arithmetic prompts,
rewarded 1 for the right number, and reports the held-out reward of greedy answers before and after.

The settings that matter (TRL's names and meanings):
- --per_device_train_batch_size counts completions; --effective_batch_size is completions per update.
- --num_generations (G ≥ 2), --max_completion_length, --temperature, --top_p; --generation_batch_size:
  completions per round (default: one update's). --num_iterations > 1 reuses a round, clipping the
  ratio to the round's policy at --epsilon (and --epsilon_high, DAPO's clip-higher).
- --loss_type grpo, dapo or dr_grpo; --importance_sampling_level sequence is GSPO.
- --beta > 0 adds the KL to the reference: the base with the adapter off (LoRA), else a frozen copy.
- --reward_funcs module:function[,module:function] and --reward_weights: your own rewards.

Outputs in --output_dir: final/, metrics.jsonl (rewards, lengths, clipping, entropy per update),
all_results.json, checkpoints/step_XXXXXX/ (a resume at a round's end continues bit-identically).
"""

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import datasets
import torch
from accelerate.utils import set_seed
from transformers import AutoTokenizer

from ft_accum.core import grpo_loss
from ft_accum.core.errors import ConfigError
from ft_accum.data import chat_data, data_sources, offline_assets, rewards
from ft_accum.models import loading, lora, low_memory
from ft_accum.training import every_rank, generation_round, run_setup
from ft_accum.training.arguments import LoraArguments, run_main


@dataclass
class TaskArguments(LoraArguments):
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Local dir or hub name. Default: the bundled SmolLM2-135M-Instruct (offline)."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (needs network). Default: generated arithmetic prompts."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local json, jsonl or csv of prompts."})
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Held-out prompts; default: 10%% of train."}
    )
    prompt_column: str = field(default="prompt", metadata={"help": "A string (one user turn) or chat turns."})
    num_generations: int = field(default=4, metadata={"help": "G: completions per prompt (≥ 2)."})
    max_completion_length: int = field(default=16, metadata={"help": "Tokens per completion at most."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the round."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling of the round (1: off)."})
    generation_batch_size: Optional[int] = field(
        default=None, metadata={"help": "Completions per round, all processes; default: the effective batch."}
    )
    generation_prompts_per_call: int = field(
        default=8, metadata={"help": "Prompts sampled together by one generate() call: more is faster, more memory."}
    )
    num_iterations: int = field(default=1, metadata={"help": "Passes over each round (> 1: clipped reuse)."})
    loss_type: str = field(default="dapo", metadata={"help": f"One of {', '.join(grpo_loss.LOSS_TYPES)}."})
    importance_sampling_level: str = field(default="token", metadata={"help": "token, or sequence (GSPO)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip of the ratio: 1 − ε."})
    epsilon_high: Optional[float] = field(default=None, metadata={"help": "Upper clip: 1 + ε_high (default ε)."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient to the reference (0: no reference)."})
    scale_rewards: bool = field(default=True, metadata={"help": "Divide advantages by the group's std."})
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "A completion cut at --max_completion_length counts nowhere."}
    )
    reward_funcs: str = field(default=rewards.BUNDLED_REWARD, metadata={"help": "module:function[,...]."})
    reward_weights: Optional[str] = field(default=None, metadata={"help": "One weight per reward function."})

    def __post_init__(self):
        super().__post_init__()
        if self.num_generations < 2:
            raise ConfigError(
                f"--num_generations {self.num_generations}: a group advantage needs ≥ 2 completions per prompt; "
                "use 4 or more"
            )
        if self.max_completion_length < 1:
            raise ConfigError(f"--max_completion_length must be ≥ 1, got {self.max_completion_length}")
        if self.loss_type not in grpo_loss.LOSS_TYPES:
            raise ConfigError(f"--loss_type must be one of {', '.join(grpo_loss.LOSS_TYPES)}, got {self.loss_type!r}")
        if self.importance_sampling_level not in grpo_loss.IMPORTANCE_SAMPLING_LEVELS:
            raise ConfigError(
                f"--importance_sampling_level must be token or sequence, got {self.importance_sampling_level!r}"
            )
        self.epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        rules = {
            "temperature": (self.temperature > 0, "> 0"),
            "top_p": (0 < self.top_p <= 1, "in (0, 1]"),
            "num_iterations": (self.num_iterations >= 1, "≥ 1"),
            "generation_prompts_per_call": (self.generation_prompts_per_call >= 1, "≥ 1"),
            "beta": (self.beta >= 0, "≥ 0"),
            "epsilon": (0 <= self.epsilon < 1, "in [0, 1)"),
            "epsilon_high": (self.epsilon_high >= 0, "≥ 0"),
        }
        for name, (ok, rule) in rules.items():
            if not ok:
                raise ConfigError(f"--{name} must be {rule}, got {getattr(self, name)}")


def build_model(task, args, accelerator):
    """(policy, reference or None, tokenizer). The reference, for --beta > 0 only: the policy with its
    adapter off under LoRA, else a frozen copy."""
    name = task.model_name_or_path or str(offline_assets.bundled_smollm2_dir())
    if task.use_lora:
        lora.import_peft()
    tokenizer = loading.load_pretrained(AutoTokenizer, name, args.trust_remote_code)
    model = run_setup.load_causal_lm(
        name, args, accelerator, frozen_base=task.use_lora, load_in_4bit=task.load_in_4bit
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding counts nowhere, so any id will do
    reference = None
    if task.beta > 0 and not task.use_lora:
        reference = copy.deepcopy(model).requires_grad_(False).eval().to(accelerator.device)
    if args.gradient_checkpointing:
        loading.enable_gradient_checkpointing(model)
    if task.use_lora:
        model = run_setup.apply_lora(model, task, args)
    return model, reference, tokenizer


def load_prompts(task, args, tokenizer) -> dict[str, list[dict]]:
    """{split: rows}, each row its columns plus `prompt_ids` (the chat template, ready to generate from)."""
    bundled = lambda seed: datasets.DatasetDict(  # noqa: E731
        train=rewards.arithmetic_task(2000, seed), validation=rewards.arithmetic_task(200, seed + 1)
    )
    raw = run_setup.load_splits(task, seed=args.seed, bundled=bundled)
    data_sources.check_columns(raw, prompt_column=task.prompt_column)  # the other columns stay: rewards read them
    raw = data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)
    splits = {}
    for split, ds in raw.items():
        rows = ds.to_list()
        for row in rows:
            turns = row[task.prompt_column]
            turns = [{"role": "user", "content": turns}] if isinstance(turns, str) else turns
            row["prompt_ids"] = chat_data.render_ids(tokenizer, turns, add_generation_prompt=True)
        splits[split] = rows
    return splits


@torch.no_grad()
def evaluate(task, args, accelerator, model, tokenizer, rows, functions, weights) -> dict:
    """The mean reward of greedy answers to the held-out prompts, on all processes together."""
    model.eval()
    total = torch.zeros(2, device=accelerator.device, dtype=torch.float64)
    for chunk, real in every_rank.rank_batches(
        list(range(len(rows))), accelerator.process_index, accelerator.num_processes, args.per_device_eval_batch_size
    ):
        prompts = [generation_round.Completion(i, 0, rows[i]["prompt_ids"], [], False) for i in chunk]
        batch = generation_round.completion_batch(prompts, tokenizer.pad_token_id, accelerator.device)
        generated = every_rank.generate(
            accelerator,
            model,
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=False,
            max_new_tokens=task.max_completion_length,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(generated[:real, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        scored, _ = rewards.weighted_rewards(functions, weights, rows, chunk[:real], texts, task.prompt_column)
        total += torch.tensor([sum(scored), real], device=accelerator.device, dtype=torch.float64)
    model.train()
    reward_sum, count = accelerator.reduce(total, reduction="sum").tolist()
    return {"eval_reward": reward_sum / max(count, 1)}


def sample_round(
    task, accelerator, model, tokenizer, rows, rewarding, sampling, layout, indices, *, seed, round_index
):
    """A round (`generation_round.SampledRound`): the completions of the prompts `rows[indices]`, their
    rewards (weighted, and per function), and this process's micro-batches, each with its group
    advantages and, when the round makes more than one update, the log-probs of the policy that
    sampled it (without them the update is on-policy: the ratio is 1)."""
    prompt_ids = [rows[i]["prompt_ids"] for i in indices]
    completions = generation_round.generate_round(
        accelerator, model, prompt_ids, indices, sampling, seed=seed, round_index=round_index
    )
    texts = tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
    prompt_indices = [c.prompt_index for c in completions]
    scored, per_function = rewards.weighted_rewards(*rewarding, rows, prompt_indices, texts, task.prompt_column)
    scored = torch.tensor(scored)
    advantages = grpo_loss.group_advantages(scored, task.num_generations, task.scale_rewards)
    batches = generation_round.micro_batches(
        completions, layout, sampling.pad_token_id, accelerator.device, task.mask_truncated_completions
    )
    for k, batch in batches.items():
        batch["advantages"] = advantages[k * layout.micro : (k + 1) * layout.micro].to(accelerator.device)
        if layout.passes > 1:  # the same number of forwards on every process: FSDP gathers in each
            with torch.no_grad():
                batch["old_log_probs"] = generation_round.completion_log_probs(model, batch)[0]
    return generation_round.SampledRound(completions, scored, per_function, batches)


def training_step(task, accelerator, model, reference, batch):
    """The micro-batch's summed loss, the numerator of --loss_type (the window divides once by the update's
    items), and [clipped tokens, entropy, KL, counted tokens] summed over its completion tokens, for the logs."""
    log_probs, entropy = generation_round.completion_log_probs(model, batch)
    old = batch.get("old_log_probs", log_probs.detach())  # on-policy by default: the ratio is 1
    mask = batch["completion_mask"]
    weights = grpo_loss.log_importance_weights(log_probs, old, mask, task.importance_sampling_level)
    per_token, clipped = grpo_loss.clipped_surrogate(weights, batch["advantages"], task.epsilon, task.epsilon_high)
    kl = torch.zeros_like(per_token)
    if task.beta > 0:
        with torch.no_grad():
            if reference is None:
                with accelerator.unwrap_model(model).disable_adapter():
                    reference_log_probs, _ = generation_round.completion_log_probs(model, batch)
            else:
                reference_log_probs, _ = generation_round.completion_log_probs(reference, batch)
        kl = grpo_loss.kl_k3(log_probs, reference_log_probs)
    loss_sum, _ = grpo_loss.loss_sums(task.loss_type, per_token + task.beta * kl, mask, task.max_completion_length)
    logs = torch.stack([(x * mask).sum() for x in (clipped.float(), entropy, kl.detach(), mask)])
    return loss_sum, logs


def train(task, args):
    for flag in ("accumulation_schedule", "auto_micro_batch", "measure_noise_scale"):
        if getattr(args, flag):
            raise ConfigError(f"--{flag}: grpo sizes each update from its round of completions; drop the flag")
    accelerator, plan = run_setup.build_accelerator(task, args, "grpo", loss_weighted_by="tokens")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)
    with accelerator.main_process_first():  # the first run converts the bundled GGUF once, on one process
        model, reference, tokenizer = build_model(task, args, accelerator)
    splits = load_prompts(task, args, tokenizer)
    functions = rewards.load_reward_functions(task.reward_funcs)
    rewarding = functions, rewards.reward_weights(task.reward_weights, len(functions))
    layout = generation_round.round_layout(
        plan,
        task.generation_batch_size,
        task.num_generations,
        task.num_iterations,
        len(splits["train"]),
        accelerator.process_index,
    )
    run_setup.fit_fsdp_units(accelerator, model)  # under FSDP: which modules shard together
    optimizer = run_setup.build_optimizer(
        model,
        args=args,
        plan=plan,
        no_decay=("bias", "norm.weight"),
        loraplus_lr_ratio=task.loraplus_lr_ratio,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    banner_rows = {
        "round": f"{layout.prompts} prompts × {task.num_generations} = {layout.completions} completions, "
        f"{layout.updates} update(s); {min(task.generation_prompts_per_call, layout.prompts)} per generate() call",
        "loss": f"{task.loss_type}, {task.importance_sampling_level}-level ratio",
        "trainable": lora.describe_trainable(model, task.lora_r if task.use_lora else None),
    }
    sampling = generation_round.Sampling(
        task.num_generations,
        task.max_completion_length,
        task.temperature,
        task.top_p,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        task.generation_prompts_per_call,
    )
    sample = functools.partial(
        sample_round, task, accelerator, model, tokenizer, splits["train"], rewarding, sampling, layout, seed=args.seed
    )
    count_items = lambda batch: grpo_loss.loss_items(task.loss_type, batch["completion_mask"])  # noqa: E731
    # Each update's window comes from a sampled round, not from a dataloader.
    rounds = functools.partial(
        generation_round.RoundWindows,
        accelerator,
        plan=plan,
        layout=layout,
        num_prompts=len(splits["train"]),
        seed=args.seed,
        sample=sample,
        count_items=count_items,
    )
    train_windows, lr_scheduler, tracker = run_setup.start_training(
        accelerator,
        args,
        plan,
        model=model,
        optimizer=optimizer,
        sample_unit="completions",
        banner_rows=banner_rows,
        batches_per_epoch=layout.rounds_per_epoch * layout.passes * plan.accumulation,
        make_windows=rounds,
    )
    evaluate_prompts = functools.partial(evaluate, task, args, accelerator, model, tokenizer, splits["validation"])
    tracker.evaluate_before_training(evaluate_prompts, *rewarding)
    model.train()
    for window in train_windows:  # one update from a round; window.num_items: its completions or tokens, all processes
        logs = torch.zeros(4, device=accelerator.device)  # clipped, entropy, KL, counted tokens
        for batch in window:
            with accelerator.accumulate(model), offload:
                loss_sum, micro_logs = training_step(task, accelerator, model, reference, batch)
                accelerator.backward(loss_sum * window.scale)  # scale = N·P / the update's items (--loss_type)
                window.add_loss(loss_sum)
                logs += micro_logs
                if accelerator.sync_gradients:  # the window's last micro-batch: a NaN loss stops before the step
                    window.check_finite_loss()
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        columns = generation_round.update_metrics(accelerator, window, logs, functions)
        tracker.end_update(window, grad_norm=grad_norm, **columns)
        if window.evaluation_due:  # an epoch's end, or every --eval_steps updates
            tracker.evaluate(evaluate_prompts, *rewarding)
    return tracker.finish(model, tokenizer=tokenizer)


def main(argv=None):
    return run_main(
        train,
        TaskArguments,
        argv,
        __doc__,
        output_dir="outputs/grpo",
        metric_for_best_model="eval_reward",
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=1e-5,
        weight_decay=0.0,
        num_train_epochs=1,
    )


if __name__ == "__main__":
    main()
