"""What the planner, the CLI and the sweeps know of each task, in one declared `TaskSpec` per task.

A task is planned by tracing its recipe's own step: `traced_step` loads the shipped recipe file (or a
copy given with --recipe) and calls the function the recipe calls in its loop, with a micro-batch in
the form the recipe collates it (`example_batch`). Nothing here dispatches on the names inside a
recipe's functions: each spec says which function it calls and how.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ft_accum.core.errors import ConfigError
from ft_accum.models.lora import parse_target_modules

# Preference tuning's reference while it trains (recipes/preference_tuning.py): the policy with its LoRA
# adapters off, a frozen copy (full DPO), or none (SimPO, ORPO, DPO with --precompute_ref_log_probs).
PREFERENCE_LOSSES = ("dpo", "simpo", "orpo")

Step = Callable[[Any, dict, Any], torch.Tensor]  # (model, batch, reference or teacher) -> the loss to backward


@dataclass(frozen=True)
class TaskSpec:
    """One task: its recipe, its model, its batch, the step traced, and what the plan adds for it."""

    recipe: str  # the shipped recipe, recipes/<recipe>.py
    auto_model: str  # the transformers Auto class its recipe builds the model with
    sequence_flag: str  # the recipe flag that sets the planned sequence length
    sample: str  # what one sample of --effective_batch_size is (`ft-accum plan --help`)
    example_batch: Callable[..., dict]  # (config, micro_batch_size, seq_len, task settings) -> a micro-batch
    traced_step: Callable[[Any, str, dict], Step]  # (recipe module, loss path, task settings) -> the step
    sequences_per_sample: int = 1  # a pair is 2: its tokens per sample are 2 × seq_len
    settings: tuple[str, ...] = ()  # the plan's keywords that only this task takes
    frozen_teacher: bool = False  # distillation: a student of the model's layers trains beside it, frozen
    dpo_reference: bool = False  # preference: DPO's reference runs beside the policy
    embedding_cache: bool = False  # contrastive: GradCache holds the update's embeddings (`embedding_cache_bytes`)
    # The batch's values steer the model's layout code (image grids, placeholder masks): traced with its
    # integer tensors as constants (tracing.layout_constants).
    layout_constants: bool = False
    # (model, lora target modules, settings) -> peft's target_modules and modules_to_save, as the recipe sets them
    lora_modules: Callable[[Any, str, dict], tuple[Any, list[str] | None]] = lambda model, targets, settings: (
        parse_target_modules(targets),
        None,
    )
    # (model, settings): what a full fine-tune freezes, as the recipe does (the vision tower)
    freeze: Callable[[Any, dict], None] = lambda model, settings: None


def _token_batch(config, micro_batch_size: int, seq_len: int) -> dict:
    ids = torch.randint(0, config.vocab_size, (micro_batch_size, seq_len))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def causal_lm_batch(config, micro_batch_size: int, seq_len: int, settings: dict) -> dict:
    """Packed blocks, as the recipe passes them with --packing: no mask, so SDPA is causal."""
    ids = torch.randint(0, config.vocab_size, (micro_batch_size, seq_len))
    return {"input_ids": ids, "labels": ids}


def preference_batch(config, micro_batch_size: int, seq_len: int, settings: dict) -> dict:
    """m pairs as chat_data.collate_pairs makes them: chosen and rejected ids, masks and labels, and each
    pair's index (where a precomputed reference log-prob is looked up); the recipe runs them as 2m rows."""
    ids = torch.randint(0, config.vocab_size, (micro_batch_size, seq_len))
    columns = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    batch = {f"{side}_{k}": v for side in ("chosen", "rejected") for k, v in columns.items()}
    return {**batch, "pair_index": torch.arange(micro_batch_size)}


def grpo_batch(config, micro_batch_size: int, seq_len: int, settings: dict) -> dict:
    """A completion batch (generation_round.completion_batch): prompt + completion columns, the last
    `completion_length` tokens scored; the advantages' values don't matter to memory."""
    batch = _token_batch(config, micro_batch_size, seq_len)
    batch["position_ids"] = torch.arange(seq_len).expand(micro_batch_size, -1)
    batch["completion_ids"] = batch["input_ids"][:, -(settings.get("completion_length") or seq_len - 1) :]
    batch["completion_mask"] = torch.ones_like(batch["completion_ids"])
    batch["advantages"] = torch.ones(micro_batch_size)
    return batch


def text_classification_batch(config, micro_batch_size: int, seq_len: int, settings: dict):
    return {
        **_token_batch(config, micro_batch_size, seq_len),
        "labels": torch.zeros(micro_batch_size, dtype=torch.long),
    }


def token_classification_batch(config, micro_batch_size: int, seq_len: int, settings: dict):
    batch = _token_batch(config, micro_batch_size, seq_len)
    return {**batch, "labels": torch.zeros_like(batch["input_ids"])}


def distillation_batch(config, micro_batch_size: int, seq_len: int, settings: dict) -> dict:
    """A chat batch whose every token is an assistant token: the most a row can count."""
    batch = _token_batch(config, micro_batch_size, seq_len)
    return {**batch, "labels": batch["input_ids"]}


def contrastive_batch(config, micro_batch_size: int, seq_len: int, settings: dict) -> dict:
    """recipes/contrastive_embedding.py's columns: an anchor and its positive per pair."""
    batch = _token_batch(config, micro_batch_size, seq_len)
    return {f"{c}_{k}": v for c in ("anchor", "positive") for k, v in batch.items()}


def seq2seq_batch(config, micro_batch_size: int, seq_len: int, settings: dict) -> dict:
    """The decoder sees as many tokens as the encoder; the recipe's collator shifts its inputs."""
    batch = _token_batch(config, micro_batch_size, seq_len)
    return {**batch, "labels": batch["input_ids"], "decoder_input_ids": batch["input_ids"]}


def vision_language_batch(config, micro_batch_size: int, seq_len: int, settings: dict) -> dict:
    """Rows opening with `images_per_sample` images of `image_size` px each (planner/vision_inputs.py)."""
    from ft_accum.planner.vision_inputs import image_layout
    from ft_accum.planner.vision_inputs import vision_language_batch as laid_out

    layout = image_layout(config, settings.get("image_size"))
    return laid_out(config, layout, micro_batch_size, seq_len, settings.get("images_per_sample", 1))


def traced_output_loss(model, loss: str, shift: bool = True):
    """The recipes' `OutputLoss` for the trace: chunked ("chunked") or from the full logits ("logits"). Fake
    tensors have no values: nothing to check against the logits, and no target spans to trim the per-row
    losses to (whole rows: what a row with targets to its end costs, an upper bound)."""
    from ft_accum.models.output_loss import OutputLoss

    return OutputLoss(model, shift=shift, enabled=loss == "chunked", check_logits=False, trim_to_targets=False)


def traced_distillation_loss(model, teacher, loss: str):
    """The distillation recipe's `DistillationLoss` for the trace, chunked through both output layers
    ("chunked") or from both full logits ("logits"); unchecked and untrimmed as `traced_output_loss`
    (every position of the example batch is an assistant token). ℓ is the costliest the recipe can
    run, an upper bound: the JSD (both KLs against the mixture) with cross-entropy mixed in."""
    from ft_accum.core.distillation_loss import distillation_token_losses
    from ft_accum.models.output_divergence import DistillationLoss

    token_losses = functools.partial(distillation_token_losses, beta=0.5, temperature=1.0, alpha=0.5)
    return DistillationLoss(
        model, teacher, token_losses=token_losses, enabled=loss == "chunked", check_logits=False, trim_to_targets=False
    )


def _sample_step(module, loss: str, settings: dict) -> Step:
    """`training_step(model, batch)`: the model's head computes the logits (classification, tagging)."""
    return lambda model, batch, reference: module.training_step(model, batch)


def _token_step(shift: bool) -> Callable[[Any, str, dict], Step]:
    """`training_step(model, batch, output_loss)`: a loss over tokens through the recipes' `OutputLoss`."""

    def step(module, loss: str, settings: dict) -> Step:
        return lambda model, batch, reference: module.training_step(
            model, batch, traced_output_loss(model, loss, shift=shift)
        )

    return step


class _NotWrapped:
    """What the preference recipe's `forward_pairs` asks of its accelerator: the model as it is (the trace's
    is not wrapped by Accelerate)."""

    @staticmethod
    def unwrap_model(model):
        return model


def _preference_step(module, loss: str, settings: dict) -> Step:
    """The recipe's `forward_pairs(task, accelerator, model, batch, output_loss=, reference=, reference_loss=)`
    with its parsed defaults at the plan's --loss; the trace's `reference` is "adapters_off" (DPO under
    LoRA: the policy with its adapters off), a frozen copy, or None (no reference model: DPO's log-probs
    read from a table, or SimPO and ORPO, which have no reference). The window's ORPO weight of the NLL is
    1 here: a scalar, no memory."""
    from ft_accum.training.recipe_modules import recipe_arguments

    task_args = recipe_arguments(module, ["--config", "none", "--loss", settings.get("preference_loss", "dpo")])[0]

    def step(model, batch, reference):
        if reference == "adapters_off":
            reference, reference_loss = None, None
        elif reference is None:  # precomputed: the table's rows, looked up by pair index
            reference, reference_loss = torch.zeros(len(batch["pair_index"]), 2), None
        else:
            reference_loss = traced_output_loss(reference, loss)
        terms = module.forward_pairs(
            task_args,
            _NotWrapped,
            model,
            batch,
            output_loss=traced_output_loss(model, loss),
            reference=reference,
            reference_loss=reference_loss,
        )
        return terms.loss_sum + terms.nll_sum

    return step


def _grpo_step(module, loss: str, settings: dict) -> Step:
    """`training_step(task, accelerator, model, reference, batch)` with the recipe's parsed defaults at β = 0
    (no reference, so no accelerator call)."""
    from ft_accum.training.recipe_modules import recipe_arguments

    task_args = recipe_arguments(module, ["--config", "none", "--beta", "0"])[0]
    return lambda model, batch, reference: module.training_step(task_args, None, model, None, batch)[0]


class _EveryRowHasImages:
    """The vision recipe's `BlankVisionPass` where every micro-batch holds images: it has nothing to add."""

    @staticmethod
    def arm(batch) -> None:
        return None


def _vision_language_step(module, loss: str, settings: dict) -> Step:
    """`training_step(model, batch, output_loss, vision_pass)`: the model's own forward, vision tower included."""
    return lambda model, batch, reference: module.training_step(
        model, batch, traced_output_loss(model, loss), _EveryRowHasImages
    )


def _vision_language_lora(model, targets: str, settings: dict) -> tuple[str, list[str]]:
    """The recipe's LoRA: the language model's linear layers; the connector (and with
    --train_vision_tower the tower) trained whole beside it (models/vision_language.py)."""
    from ft_accum.models import vision_language

    trained = vision_language.trained_parts(model, settings.get("train_vision_tower", False))
    return vision_language.lora_targets(model, targets), trained


def _freeze_vision_tower(model, settings: dict) -> None:
    from ft_accum.models import vision_language

    if not settings.get("train_vision_tower"):
        vision_language.freeze_vision_tower(model)


def _contrastive_step(module, loss: str, settings: dict) -> Step:
    """GradCache's replay (`embed`): the micro-batch's embeddings times their cached gradients."""
    return lambda model, batch, reference: sum((e * torch.ones_like(e)).sum() for e in module.embed(model, batch))


def _distillation_step(module, loss: str, settings: dict) -> Step:
    """`training_step(student, teacher, batch, distillation_loss)` on the student and the frozen teacher."""
    return lambda model, batch, teacher: module.training_step(
        model, teacher, batch, traced_distillation_loss(model, teacher, loss)
    )


TASK_SPECS: dict[str, TaskSpec] = {
    "causal_lm": TaskSpec(
        recipe="causal_lm",
        auto_model="AutoModelForCausalLM",
        sequence_flag="--block_size",
        sample="a block of seq_len tokens",
        example_batch=causal_lm_batch,
        traced_step=_token_step(shift=True),
    ),
    "text_classification": TaskSpec(
        recipe="text_classification",
        auto_model="AutoModelForSequenceClassification",
        sequence_flag="--max_seq_length",
        sample="a text of seq_len tokens",
        example_batch=text_classification_batch,
        traced_step=_sample_step,
    ),
    "token_classification": TaskSpec(
        recipe="token_classification",
        auto_model="AutoModelForTokenClassification",
        sequence_flag="--max_seq_length",
        sample="a sentence of seq_len tokens",
        example_batch=token_classification_batch,
        traced_step=_sample_step,
    ),
    "seq2seq": TaskSpec(
        recipe="seq2seq",
        auto_model="AutoModelForSeq2SeqLM",
        sequence_flag="--max_source_length",
        sample="a source of seq_len tokens and a target as long",
        example_batch=seq2seq_batch,
        traced_step=_token_step(shift=False),
    ),
    "preference": TaskSpec(
        recipe="preference_tuning",
        auto_model="AutoModelForCausalLM",
        sequence_flag="--max_seq_length",
        sample="a pair (two sequences of seq_len tokens)",
        example_batch=preference_batch,
        traced_step=_preference_step,
        sequences_per_sample=2,
        settings=("preference_loss", "precompute_ref_log_probs"),
        dpo_reference=True,
    ),
    "grpo": TaskSpec(
        recipe="grpo",
        auto_model="AutoModelForCausalLM",
        sequence_flag="--max_completion_length",
        sample="a completion (seq_len = prompt + completion tokens, its last --completion_length scored)",
        example_batch=grpo_batch,
        traced_step=_grpo_step,
        settings=("completion_length",),
    ),
    "contrastive": TaskSpec(
        recipe="contrastive_embedding",
        auto_model="AutoModel",  # a bi-encoder: the encoder's pooled hidden states, no head
        sequence_flag="--max_seq_length",
        sample="a pair (an anchor and a positive of seq_len tokens each)",
        example_batch=contrastive_batch,
        traced_step=_contrastive_step,
        sequences_per_sample=2,
        embedding_cache=True,
    ),
    "distillation": TaskSpec(
        recipe="distillation",
        auto_model="AutoModelForCausalLM",
        sequence_flag="--max_seq_length",
        sample="a conversation of seq_len tokens, every one counted (--model is the teacher, the student --student_layers of its layers)",
        example_batch=distillation_batch,
        traced_step=_distillation_step,
        settings=("student_layers",),
        frozen_teacher=True,
    ),
    "vision_language": TaskSpec(
        recipe="vision_language",
        auto_model="AutoModelForImageTextToText",
        sequence_flag="--max_seq_length",
        sample="a conversation of seq_len tokens, its --images_per_sample images' tokens included",
        example_batch=vision_language_batch,
        traced_step=_vision_language_step,
        settings=("image_size", "images_per_sample", "train_vision_tower"),
        layout_constants=True,
        lora_modules=_vision_language_lora,
        freeze=_freeze_vision_tower,
    ),
}
TASKS = tuple(TASK_SPECS)


def task_spec(task: str) -> TaskSpec:
    if task not in TASK_SPECS:
        raise ConfigError(f"unknown task {task!r}; plan one of {', '.join(TASKS)}")
    return TASK_SPECS[task]


def build_model(config, task: str, dtype: torch.dtype = torch.float32):
    """A randomly initialised model of `task`'s class from a config: what is traced."""
    import transformers

    auto = getattr(transformers, task_spec(task).auto_model)
    if getattr(config, "pad_token_id", 0) is None and task_spec(task).auto_model.endswith("SequenceClassification"):
        # The head finds each row's last real token by the pad id, which GPT-2's config lacks (its forward then
        # refuses batches over 1); the trace's rows have no padding, so any id does: EOS.
        config.pad_token_id = config.eos_token_id if config.eos_token_id is not None else 0
    try:
        # Built in its final dtype: Module.to() cannot convert fake parameters (torch swaps them).
        return auto.from_config(config, dtype=dtype)
    except ValueError as exc:
        raise ConfigError(
            f"a {config.model_type} model has no {task} head; pick another --task (one of {', '.join(TASKS)})"
        ) from exc


def example_batch(config, task: str, micro_batch_size: int, seq_len: int, **settings) -> dict[str, torch.Tensor]:
    """A random micro-batch of `micro_batch_size` samples of `seq_len` tokens, as `task`'s recipe collates it;
    `settings` are the task's (`TaskSpec.settings`: completion_length, image_size, images_per_sample)."""
    return task_spec(task).example_batch(config, micro_batch_size, seq_len, settings)


def recipe_path(task: str, recipe: str | Path | None = None) -> Path:
    """The recipe whose training step the plan traces: `recipe` (a path), or the task's shipped one."""
    from ft_accum.training.recipe_files import shipped_recipe

    if recipe is None:
        return shipped_recipe(task_spec(task).recipe)
    if not Path(recipe).is_file():
        raise ConfigError(f"no recipe at {recipe} to trace the training step of; give --recipe recipes/<name>.py")
    return Path(recipe)


def recipe_step(task: str, recipe: str | Path | None, loss: str, settings: dict | None = None) -> Step:
    """`step(model, batch, reference) -> loss` for the trace: the task's step from the recipe file, loaded by
    path, so that a change to a recipe's step (or a copy's) changes its plan; `loss` is "chunked", or
    "logits" for --no_chunked_loss. "model" is the model's own loss, `model(**batch).loss`: what a plain
    PyTorch loop and the Trainer run."""
    if loss == "model":
        return lambda model, batch, reference: model(**batch).loss
    from ft_accum.training.recipe_modules import load_recipe_module

    return task_spec(task).traced_step(load_recipe_module(recipe_path(task, recipe)), loss, settings or {})


def embedding_cache_bytes(effective_batch_size: int, hidden_size: int, columns: int = 2) -> float:
    """The bytes GradCache (training/embedding_cache.py) holds beside one micro-batch's activations: the
    update's E × columns embeddings and their cached gradients in fp32, 2 · 4 · E · C · d, and the first
    pass's E × E·(C − 1) scores with their softmax and its gradient, 3 · 4 · E² · (C − 1). The scores live
    only while no micro-batch's activations do; counting both at once errs high, by the scores' share."""
    embeddings = 2 * 4 * effective_batch_size * columns * hidden_size
    return embeddings + 3 * 4 * effective_batch_size**2 * (columns - 1)
