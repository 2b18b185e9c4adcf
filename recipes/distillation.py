r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/distillation.py \
    --config recipes/configs/distillation.yaml

Distil a chat model into a smaller student on the teacher's token distributions, exact over the update.

The student learns the teacher's whole next-token distribution at every assistant token, not only the
token the data has: forward KL (Hinton et al. 2015), reverse KL, or GKD's generalized Jensen-Shannon
divergence between them (--beta: 0 forward, 1 reverse; Agarwal et al. 2024), at --temperature (with
Hinton's τ² factor), and --alpha of the ordinary cross-entropy mixed in (1: cross-entropy only, the
comparison that says whether distillation is worth it). --lmbda: GKD's share of sequences the student
answers itself, decided and sampled per sequence; --teacher_load_in_4bit: the teacher in NF4. Each
update is the sum over its assistant tokens on every micro-batch and process, divided once by their
number; neither model's full logits are ever built (ft_accum/models/output_divergence.py).

With no flags the teacher is the bundled SmolLM2-135M-Instruct and the student its own 15 evenly
spaced layers of 30 (--student_layers; DistilBERT's start, no second download), trained on the BBC
News instructions of the instruction-tuning recipe; it reports, before and after, the held-out
assistant-token loss, the divergence from the teacher, and the exact match of the one-word answers.
Your own student: --model_name_or_path (its tokenizer must be the teacher's vocabulary).

Data as recipes/instruction_tuning.py reads it: --train_file (json, jsonl, csv) or --dataset_name with
a `messages` column of {role, content} turns, ShareGPT's `conversations`, Alpaca's columns, or
`prompt` and `completion`.

Outputs in --output_dir: final/ (the student; `ft-accum export RUN_DIR --format gguf` for a Llama),
metrics.jsonl, all_results.json, checkpoints/. SIGTERM or Ctrl-C finishes the current update, saves a
checkpoint and prints the resume command.
"""

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from accelerate.utils import set_seed
from transformers import AutoTokenizer

from ft_accum.core import distillation_loss
from ft_accum.core.errors import ConfigError
from ft_accum.data import chat_data, data_sources, offline_assets
from ft_accum.models import layer_selection, loading, lora, low_memory
from ft_accum.models.output_divergence import DistillationLoss
from ft_accum.training import chat_evaluation, on_policy, run_setup
from ft_accum.training.arguments import LoraArguments, NEFTuneArguments, run_main


@dataclass
class TaskArguments(LoraArguments, NEFTuneArguments):
    teacher_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "The teacher: a run's final/ (a LoRA adapter: merged into its base) or hub name."},
    )
    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "The student. Default: --student_layers of the teacher's own layers."}
    )
    teacher_load_in_4bit: bool = field(
        default=False,
        metadata={"help": "The frozen teacher in NF4 4-bit weights, a quarter of its memory ([lowmem])."},
    )
    student_layers: Optional[int] = field(
        default=None, metadata={"help": "Layers of the student built from the teacher (default: half of them)."}
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub dataset (needs network). Default: BBC News instructions (offline)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Local json, jsonl or csv."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Local file; default: 10%% of train."})
    messages_column: str = field(default="messages", metadata={"help": "Column of {role, content} turns."})
    prompt_column: str = field(default="prompt", metadata={"help": "Without messages: the user's prompt."})
    completion_column: str = field(default="completion", metadata={"help": "Without messages: the answer."})
    max_seq_length: int = field(default=256, metadata={"help": "Tokens per conversation (longer: cut)."})
    beta: float = field(default=0.5, metadata={"help": "GKD's JSD mix: 0 forward KL, 1 reverse KL, between: JSD."})
    temperature: float = field(default=1.0, metadata={"help": "Softmax temperature of both models (> 0)."})
    alpha: float = field(default=0.0, metadata={"help": "Weight of the cross-entropy on the data (1: CE only)."})
    lmbda: float = field(
        default=0.0, metadata={"help": "GKD's on-policy share: sequences the student answers itself."}
    )
    max_completion_length: int = field(default=64, metadata={"help": "On-policy answers: at most this many tokens."})
    chunked_loss: bool = field(default=True, metadata={"help": "Loss from the hidden states in chunks (exact)."})
    exact_match_max_words: int = field(default=1, metadata={"help": "Exact match on answers of ≤ this many words."})
    max_new_tokens: int = field(default=8, metadata={"help": "Generation length for the exact-match score."})

    def __post_init__(self):
        super().__post_init__()
        distillation_loss.check_distillation_settings(self.beta, self.temperature, self.alpha, self.lmbda)
        for name in ("max_seq_length", "exact_match_max_words", "max_new_tokens", "max_completion_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be ≥ 1, got {getattr(self, name)}")


NO_DECAY = ("bias", "norm.weight")


def build_models(task, args, accelerator):
    """(student, frozen teacher, tokenizer, which teacher layers the student kept or None)."""
    teacher_name = task.teacher_name_or_path or str(offline_assets.bundled_smollm2_dir())
    if task.load_in_4bit:
        raise ConfigError(
            "--load_in_4bit: the student trains its weights here; for a 4-bit teacher: --teacher_load_in_4bit"
        )
    if task.use_lora:
        lora.import_peft()  # a missing peft fails before the models load
    tokenizer = loading.load_pretrained(AutoTokenizer, teacher_name, args.trust_remote_code)
    chat_data.resolve_chat_template(tokenizer, None, teacher_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of the loss, so any id will do
    # A student built from the teacher's layers copies them in full precision; then the teacher may load in 4 bits.
    teacher_4bit = task.teacher_load_in_4bit and task.model_name_or_path is not None
    teacher = run_setup.load_causal_lm(teacher_name, args, accelerator, frozen_base=False, load_in_4bit=teacher_4bit)
    kept = None
    if task.model_name_or_path:
        student = run_setup.load_causal_lm(task.model_name_or_path, args, accelerator, frozen_base=task.use_lora)
        loading.check_same_vocabulary(task.model_name_or_path, tokenizer, teacher_name, args.trust_remote_code)
    else:
        student, kept = layer_selection.student_from_teacher(teacher, task.student_layers)
        if task.teacher_load_in_4bit:
            teacher = run_setup.load_causal_lm(teacher_name, args, accelerator, frozen_base=True, load_in_4bit=True)
    teacher.requires_grad_(False).eval()  # frozen: no gradients, no optimizer state
    if not task.teacher_load_in_4bit:  # in the compute dtype (the student has its copy); 4-bit: placed as it loads
        loading.cast_and_compile(
            teacher, args.model_dtype, mixed_precision=accelerator.mixed_precision, frozen_base=True
        )
        teacher.to(accelerator.device)
    loading.check_context_length(student.config, task.max_seq_length, "--max_seq_length")
    if args.gradient_checkpointing:
        loading.enable_gradient_checkpointing(student)
    if task.use_lora:
        student = run_setup.apply_lora(student, task, args)
    return student, teacher, tokenizer, kept


def load_conversations(task, args):
    """{split: [conversation, ...]}, every row checked (a list of known roles with an assistant turn)."""
    raw = run_setup.load_splits(task, seed=args.seed, bundled=lambda seed: offline_assets.load_bbc_instructions(seed))
    raw = data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)
    return chat_data.conversations_of(raw, task.messages_column, task.prompt_column, task.completion_column)


def build_dataloaders(task, args, accelerator, conversations, tokenizer):
    with accelerator.main_process_first():
        tokenized = chat_data.tokenize_splits(tokenizer, conversations, task.max_seq_length)
    train_dataloader, eval_dataloader = data_sources.seeded_dataloaders(
        {split: on_policy.with_row_index(chats.rows) for split, chats in tokenized.items()},
        chat_data.collate_chats(tokenizer.pad_token_id, packed=False),
        args.per_device_train_batch_size,
        args.per_device_eval_batch_size,
        args.seed,
    )
    return train_dataloader, eval_dataloader, tokenized


def model_inputs(batch):
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}


def count_items(batch):
    """What the loss is a mean over: assistant tokens, counted after the causal shift (the rest are -100)."""
    return (batch["labels"][:, 1:] != -100).sum()


def training_step(model, teacher, batch, distill):
    """The micro-batch's loss summed over its assistant tokens (the window divides once by their count)."""
    return distill(model, teacher, batch["labels"], **model_inputs(batch))[0]


@torch.no_grad()
def evaluate(task, model, teacher, eval_dataloader, accelerator, distill, divergence, tokenizer, conversations):
    """Held out: the assistant-token cross-entropy, the divergence from the teacher per assistant token
    (the chosen β and τ, without --alpha), and the exact match of the one-word answers."""
    model.eval()
    cross_entropy = distill.student.mean_loss(model, eval_dataloader, accelerator, model_inputs)
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch in eval_dataloader:
        loss_sum, tokens = divergence(model, teacher, batch["labels"], **model_inputs(batch))
        # gather_for_metrics drops the rows Accelerate repeated to even out the last batch.
        loss_sum, tokens = accelerator.gather_for_metrics((loss_sum.reshape(1), tokens.reshape(1)))
        totals += torch.stack([loss_sum.sum().double(), tokens.sum().double()])
    exact = chat_evaluation.exact_match(
        accelerator,
        model,
        tokenizer,
        conversations,
        max_words=task.exact_match_max_words,
        max_new_tokens=task.max_new_tokens,
    )
    model.train()
    divergence_per_token = (totals[0] / totals[1]).item()
    return {
        "eval_loss": cross_entropy,
        "eval_perplexity": math.exp(min(cross_entropy, 50)),
        "eval_divergence": divergence_per_token,
        "eval_exact_match": exact,
    }


def build_losses(task, accelerator, model, teacher):
    """(the training loss, ℓ with --alpha; the held-out divergence from the teacher, ℓ without it)."""
    losses = functools.partial(
        distillation_loss.distillation_token_losses, beta=task.beta, temperature=task.temperature, alpha=task.alpha
    )
    unwrapped = accelerator.unwrap_model(model)
    return tuple(
        DistillationLoss(unwrapped, teacher, token_losses=loss, accelerator=accelerator, enabled=task.chunked_loss)
        for loss in (losses, functools.partial(losses, alpha=0.0))
    )


def student_answers(task, args, accelerator, model, tokenizer):
    """--lmbda's on-policy answers, made as each window is fetched (before its tokens are counted)."""
    settings = on_policy.OnPolicy(
        task.lmbda,
        args.seed,
        task.max_completion_length,
        task.max_seq_length,
        task.temperature,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    return on_policy.StudentAnswers(accelerator, model, settings)


def describe_run(task, model, teacher, kept, distill, answers, tokenized) -> dict[str, str]:
    """The banner's lines about the two models, the loss and the data."""
    student = f"the teacher's layers {kept}" if kept is not None else task.model_name_or_path
    weights = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in teacher.parameters()}))  # 4-bit: uint8
    rows = {
        "teacher": f"{teacher.config.name_or_path}: frozen, {weights} weights",
        "student": f"{student}: {lora.describe_trainable(model, task.lora_r if task.use_lora else None)}",
        "loss": f"{distillation_loss.describe(task.beta, task.temperature, task.alpha)}; {distill.path}",
        "conversations": f"{len(tokenized['train'].rows)} train / {len(tokenized['validation'].rows)} eval",
    }
    if task.lmbda:
        rows["on-policy"] = answers.settings.describe()
    return rows


def train(task, args):
    accelerator, plan = run_setup.build_accelerator(task, args, "distillation", loss_weighted_by="tokens")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    conversations = load_conversations(task, args)
    with accelerator.main_process_first():  # the first run converts the bundled GGUF once, on one process
        model, teacher, tokenizer, kept = build_models(task, args, accelerator)
    train_dataloader, eval_dataloader, tokenized = build_dataloaders(task, args, accelerator, conversations, tokenizer)
    run_setup.fit_fsdp_units(accelerator, model)  # under FSDP: which modules shard together
    optimizer = run_setup.build_optimizer(model, args=args, plan=plan, no_decay=NO_DECAY)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    distill, divergence = build_losses(task, accelerator, model, teacher)
    answers = student_answers(task, args, accelerator, model, tokenizer)
    rows = describe_run(task, model, teacher, kept, distill, answers, tokenized)
    mean_tokens = sum(len(r["input_ids"]) for r in tokenized["train"].rows) / len(tokenized["train"].rows)
    train_windows, lr_scheduler, tracker = run_setup.start_training(
        accelerator,
        args,
        plan,
        model=model,
        optimizer=optimizer,
        train_dataloader=train_dataloader,
        count_items=count_items,
        unit="assistant tokens",
        sample_unit="conversations",
        banner_rows=rows,
        mean_tokens_per_sample=mean_tokens,
        neftune_noise_alpha=task.neftune_noise_alpha,
        prepare_batch=answers,  # --lmbda: the student's own answers, before the window counts its tokens
    )
    evaluation = functools.partial(
        evaluate,
        task,
        model,
        teacher,
        eval_dataloader,
        accelerator,
        distill,
        divergence,
        tokenizer,
        conversations["validation"],
    )
    tracker.evaluate_before_training(evaluation)
    model.train()
    for window in train_windows:  # one optimizer update; window.num_items: its assistant tokens, on every process
        for batch in window:
            with accelerator.accumulate(model), offload, window.retry_on_out_of_memory():
                loss_sum = training_step(model, teacher, batch, distill)
                # Σ loss / num_items over the window: scale = N·P / num_items undoes backward's ÷N and DDP's ÷P
                accelerator.backward(loss_sum * window.scale)
                window.add_loss(loss_sum)
                if accelerator.sync_gradients:  # the window's last micro-batch: a NaN loss stops before the step
                    window.check_finite_loss()
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        tracker.end_update(window, grad_norm=grad_norm, **answers.columns())
        if window.evaluation_due:  # an epoch's end, or every --eval_steps updates
            tracker.evaluate(evaluation)
    return tracker.finish(model, tokenizer=tokenizer)


def main(argv=None):
    return run_main(
        train,
        TaskArguments,
        argv,
        __doc__,
        output_dir="outputs/distillation",
        metric_for_best_model="eval_exact_match",
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=2e-4,
        weight_decay=0.0,
        num_train_epochs=1,
    )


if __name__ == "__main__":
    main()
