"""What every recipe does around its own setup: before it loads data, the Accelerator and the output
folder (`build_accelerator`); the optimizer (`build_optimizer`); after `accelerator.prepare`, the rest
in one call (`start_training`: the updates planned, the LR scheduler, the banner, resume, the windows,
the tracker). Hardware and precision come from the Accelerate config, not from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DistributedType, GradientAccumulationPlugin

from ft_accum.core.errors import ConfigError
from ft_accum.core.lr_scaling import describe_lr_scaling
from ft_accum.models.loading import describe_dtypes
from ft_accum.models.low_memory import adamw_8bit, adamw_8bit_stochastic_rounding
from ft_accum.models.neftune import add_neftune_noise
from ft_accum.training import checkpointing, collective_timeout, model_card, training_state
from ft_accum.training.banner import format_banner
from ft_accum.training.graceful_stop import GracefulStop, started_command, without_resume
from ft_accum.training.run_outputs import (
    check_accelerator,
    describe_engine,
    local_tracker_settings,
    prepare_output_dir,
    resolve_report_to,
    tracker_config,
)
from ft_accum.training.training_state import RunTracker


def build_accelerator(task_args, args, project_name: str, loss_weighted_by: str = "samples"):
    """(the run's Accelerator, its BatchPlan), after the checks that refuse launches it would silently run
    wrong (`check_accelerator`), the batch split's (`BatchPlan.from_settings`, the one place it is made
    and checked: before --output_dir is touched), and the guard on --output_dir; trackers started when
    --report_to has one.

    The batch plan follows from the process count, which only the Accelerator knows for sure (a bare
    PartialState() ignores ACCELERATE_USE_CPU and would report one process under DDP on CPU); each
    window then tells Accelerate its micro-batch count (training/windows.py).
    """
    report_to = resolve_report_to(args.report_to)
    accelerator = Accelerator(
        log_with=report_to,
        project_dir=args.output_dir,
        # A seeded sampler makes the sample order depend on the seed and epoch only, not on the split.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        # Each window sets its own micro-batch count (training/windows.py: start_window); it is fetched before it
        # runs, so the loader's end, which Accelerate would otherwise sync at, comes early.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=1, sync_each_batch=args.sync_each_batch, sync_with_dataloader=False
        ),
        kwargs_handlers=[collective_timeout.process_group_kwargs(args.ddp_timeout)],
    )
    collective_timeout.start_run(args.ddp_timeout, accelerator.process_index, accelerator.num_processes)
    check_accelerator(accelerator, loss_weighted_by=loss_weighted_by)
    plan = args.batch_plan(accelerator.num_processes)
    resume_asked = bool(args.resume_from_checkpoint)  # auto with nothing to resume starts afresh, unrefused
    args.resume_from_checkpoint = checkpointing.resolve_auto_resume(args.resume_from_checkpoint, args.output_dir)
    prepare_output_dir(
        args.output_dir,
        resume=resume_asked,
        overwrite=args.overwrite_output_dir,
        is_main_process=accelerator.is_main_process,
    )
    settings = dataclasses.asdict(task_args) | dataclasses.asdict(args)
    config_file = Path(args.output_dir) / model_card.RUN_CONFIG_FILE
    if accelerator.is_main_process and (not args.resume_from_checkpoint or not config_file.exists()):
        # The fresh start's command and settings, for final/README.md and ft-accum export (a resume keeps them).
        model_card.write_run_config(args.output_dir, project_name, settings, without_resume(started_command()))
    accelerator.wait_for_everyone()
    if report_to:
        accelerator.init_trackers(
            project_name,
            config=tracker_config(settings, plan, args.scaled_learning_rate(plan.effective)),
            init_kwargs=local_tracker_settings(report_to, args.output_dir),
        )
    return accelerator, plan


def build_optimizer(
    model: torch.nn.Module,
    args,
    plan,
    no_decay: tuple[str, ...],
    loraplus_lr_ratio: float | None = None,
) -> torch.optim.Optimizer:
    """At --learning_rate scaled to the plan's effective batch (--lr_scaling; computed here, once: the banner
    reads it back from `optimizer.defaults`), AdamW (fused, the Trainer's default too), bitsandbytes' 8-bit AdamW (`--optim adamw_8bit`,
    see low_memory.adamw_8bit) or SGD with momentum 0.9, over the trainable parameters; no weight
    decay on those whose names end with one of `no_decay` (biases, norms).

    With `loraplus_lr_ratio` (LoRA+, Hayou et al. 2024, arXiv:2402.12354), peft's
    `create_loraplus_optimizer` groups the parameters: the B matrices (and DoRA's magnitudes) at
    ratio × the LR. Each of its groups records its `lr_ratio` to the peak LR, which the LR scaling
    of an accumulation schedule keeps (accumulation_schedule.set_peak_learning_rate; 1 when absent).
    """

    def optimizer_for(groups, lr):
        if args.optim == "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=0.9)
        if args.optim == "adamw_8bit":
            return adamw_8bit(groups, lr)
        if args.optim == "adamw_torch_8bit":
            return adamw_8bit_stochastic_rounding(groups, lr, bf16_weights=args.model_dtype == "bfloat16")
        return torch.optim.AdamW(groups, lr=lr, fused=True)

    learning_rate = args.scaled_learning_rate(plan.effective)
    if loraplus_lr_ratio:
        from peft.optimizers import create_loraplus_optimizer

        optimizer = create_loraplus_optimizer(
            model,
            optimizer_for,
            lr=learning_rate,
            loraplus_lr_ratio=loraplus_lr_ratio,
            loraplus_weight_decay=args.weight_decay,
        )
        for group in optimizer.param_groups:
            group["lr_ratio"] = group["lr"] / learning_rate
        return optimizer
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trainable if not n.endswith(no_decay)], "weight_decay": args.weight_decay},
        {"params": [p for n, p in trainable if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    return optimizer_for(groups, learning_rate)


def run_banner(
    accelerator,
    args,
    plan,
    windows: list[list[int]],
    mean_tokens_per_sample: float | None = None,
    extra: dict[str, str] | None = None,
    unit: str = "samples",
    *,
    model,
    optimizer,
) -> str:
    """The banner of `format_banner` for a recipe's settings: batch arithmetic, LR, updates, dtypes, features on."""
    features = {
        "engine": describe_engine(accelerator.distributed_type.value, accelerator.num_processes),
        "dtypes": describe_dtypes(model, optimizer, accelerator.mixed_precision),
        "torch.compile": "on: each repeated block (the first updates compile)" if args.torch_compile else None,
        "trust_remote_code": "ON: the model's own Python code ran" if args.trust_remote_code else None,
        "auto micro-batch": "on: out of memory halves the micro-batch, doubles the accumulation"
        if args.auto_micro_batch
        else None,
        "accumulation schedule": f"{args.accumulation_schedule} (LR scaling re-applied at each change)"
        if args.accumulation_schedule
        else None,
        "noise scale": "measured every update" if args.measure_noise_scale else None,
        "evaluation": f"every {args.eval_steps} updates and at each epoch's end" if args.eval_steps else None,
        "early stopping": f"after {args.early_stopping_patience} evaluation(s) without {args.metric_for_best_model} "
        f"{'rising' if args.greater_is_better else 'falling'} by more than {args.early_stopping_threshold}"
        if args.early_stopping_patience
        else None,
        "best model": f"final/ holds the best {args.metric_for_best_model} evaluation's weights"
        if args.load_best_model_at_end
        else None,
    }
    lr_line = describe_lr_scaling(
        args.learning_rate,
        optimizer.defaults["lr"],  # build_optimizer's scaled LR
        plan.effective,
        args.base_batch_size,
        args.lr_scaling,
        args.optim,
    )
    return format_banner(
        per_device_train_batch_size=plan.micro,
        gradient_accumulation_steps=plan.accumulation,
        num_processes=plan.processes,
        lr_line=lr_line,
        mixed_precision=accelerator.mixed_precision,
        gradient_checkpointing=args.gradient_checkpointing,
        num_update_steps=sum(map(len, windows)),
        num_train_epochs=len(windows),
        updates_per_epoch=len(windows[0]),
        mean_tokens_per_sample=mean_tokens_per_sample,
        extra={**(extra or {}), **{k: v for k, v in features.items() if v}},
        unit=unit,
    )


def reset_accelerate_state(keep_process_group: bool = False) -> None:
    """Forget Accelerate's process-wide singletons, so that the next recipe in this process starts clean.
    With `keep_process_group`, the next `Accelerator` joins the same distributed group (PartialState).

    Accelerate has no public way: its own tests call these private `_reset_state` methods. This is the
    one place that does, for `ft-accum check` and every test and benchmark;
    tests/test_batch_arithmetic.py fails if an upgrade removes them.
    """
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=not keep_process_group)
    GradientState._reset_state()


class TrainingRun(NamedTuple):
    """What the loop uses (see `start_training`)."""

    train_windows: Iterable  # one Window per optimizer update
    lr_scheduler: Any  # prepared; sized in updates, not micro-batches
    tracker: RunTracker  # once per update: the counters, the log, checkpoints, the graceful stop; the end


def start_training(
    accelerator,
    args,
    plan,
    *,
    model,
    optimizer,
    count_items=None,
    train_dataloader=None,
    unit: str = "samples",
    sample_unit: str = "samples",
    banner_rows: dict[str, str] | None = None,
    mean_tokens_per_sample: float | None = None,
    prepare_batch=None,
    batches_per_epoch: int | None = None,
    make_windows=None,
    neftune_noise_alpha: float | None = None,
) -> TrainingRun:
    """The ft-accum plumbing after `accelerator.prepare`, in the one order that works: the run's updates
    planned (`UpdatePlan`: windows per epoch, --accumulation_schedule) and its LR scheduler sized in
    them; the start-of-run banner; a fresh state or --resume_from_checkpoint's; the windows from that
    state (`TrainWindows` over `train_dataloader`, counting `count_items` in `unit`: what the loss is a
    mean over; or `make_windows(state=, update_plan=)`, GRPO's rounds, with `batches_per_epoch`); and
    the tracker. The banner counts the batch in `sample_unit` (what one row is: sequences, pairs) and
    adds `banner_rows`.

    `prepare_batch(batch, update)` rewrites each micro-batch before its window is counted (TrainWindows).
    `neftune_noise_alpha`: NEFTune's noise on the model's input embeddings in training forwards, seeded by
    the update (models/neftune.py).
    """
    from ft_accum.training.noise_meter import NoiseScaleMeter
    from ft_accum.training.update_plan import UpdatePlan
    from ft_accum.training.windows import EvaluatedWindows, TrainWindows

    update_plan = UpdatePlan(
        accelerator,
        optimizer,
        plan,
        batches_per_epoch or len(train_dataloader),
        schedule=args.parsed_schedule,
        num_train_epochs=args.num_train_epochs,
        max_train_steps=args.max_train_steps,
        lr_scheduler_type=args.lr_scheduler_type,
        num_warmup_steps=args.num_warmup_steps,
        scaled_learning_rate=args.scaled_learning_rate,
    )
    if neftune_noise_alpha:
        banner_rows = {**(banner_rows or {}), "NEFTune": f"α {neftune_noise_alpha}: each row's real tokens, α/√(Lᵢ·d)"}
    accelerator.print(
        run_banner(
            accelerator,
            args,
            plan,
            update_plan.windows,
            mean_tokens_per_sample,
            banner_rows,
            sample_unit,
            model=model,
            optimizer=optimizer,
        )
    )
    state, signature = training_state.start_or_resume(
        accelerator,
        model,
        plan,
        seed=args.seed,
        optim=args.optim,
        accumulation_schedule=args.accumulation_schedule,
        resume_from_checkpoint=args.resume_from_checkpoint,
        output_dir=args.output_dir,
    )
    if neftune_noise_alpha:
        add_neftune_noise(accelerator.unwrap_model(model), neftune_noise_alpha, args.seed, lambda: state.step)
    if make_windows is not None:
        train_windows = make_windows(state=state, update_plan=update_plan)
    else:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        train_windows = TrainWindows(
            accelerator,
            train_dataloader,
            state,
            plan,
            count_items=count_items,
            update_plan=update_plan,
            noise=NoiseScaleMeter(parameters, plan, unit) if args.measure_noise_scale else None,
            auto_micro_batch=args.auto_micro_batch,
            tokens_are_items="token" in unit,  # target, assistant, labelled tokens: tokens_seen counts them
            prepare_batch=prepare_batch,
        )
    train_windows = EvaluatedWindows(train_windows, state, args.eval_steps)
    settings = training_state.RunSettings(
        output_dir=args.output_dir,
        checkpointing_steps=args.checkpointing_steps,
        save_total_limit=args.save_total_limit,
        max_consecutive_skipped_updates=args.max_consecutive_skipped_updates,
        scaled_learning_rate=args.scaled_learning_rate,
        best_model=training_state.BestModelSettings(
            metric=args.metric_for_best_model,
            greater_is_better=args.greater_is_better,
            patience=args.early_stopping_patience,
            threshold=args.early_stopping_threshold,
            load_at_end=args.load_best_model_at_end,
        ),
    )
    tracker = RunTracker(
        accelerator,
        settings,
        state,
        signature,
        update_plan.num_update_steps,
        GracefulStop(),
        lr_scheduler=update_plan.lr_scheduler,
        train_windows=train_windows,
    )
    return TrainingRun(train_windows, update_plan.lr_scheduler, tracker)


# The readers of the argument dataclasses for the library below: the library takes values.


def load_splits(task_args, seed: int, bundled):
    """data_sources.load_splits from a recipe's --train_file, --validation_file, --dataset_name, --dataset_config_name."""
    from ft_accum.data.data_sources import load_splits as load

    return load(
        train_file=task_args.train_file,
        validation_file=task_args.validation_file,
        dataset_name=task_args.dataset_name,
        dataset_config_name=task_args.dataset_config_name,
        seed=seed,
        bundled=bundled,
    )


def lora_settings(task_args):
    """A recipe's LoraArguments (--lora_r, --lora_alpha, --lora_dropout, --lora_target_modules,
    --use_rslora, --use_dora) as a LoraSettings."""
    from ft_accum.models.lora import LoraSettings

    return LoraSettings(
        r=task_args.lora_r,
        alpha=task_args.lora_alpha,
        dropout=task_args.lora_dropout,
        target_modules=task_args.lora_target_modules,
        use_rslora=task_args.use_rslora,
        use_dora=task_args.use_dora,
    )


def load_causal_lm(name: str, args, accelerator, *, frozen_base: bool, load_in_4bit: bool = False, auto_class=None):
    """models.loading.load_causal_lm with the shared arguments' --model_dtype, --torch_compile, --trust_remote_code."""
    from ft_accum.models.loading import load_causal_lm as load

    return load(
        name,
        accelerator,
        model_dtype=args.model_dtype,
        torch_compile=args.torch_compile,
        trust_remote_code=args.trust_remote_code,
        frozen_base=frozen_base,
        load_in_4bit=load_in_4bit,
        auto_class=auto_class,
    )


def apply_lora(model, task_args, args, *, target_modules: str | None = None, modules_to_save: list[str] | None = None):
    """models.lora.apply_lora with a recipe's --lora_* flags, --gradient_checkpointing and --model_dtype
    (`target_modules`, `modules_to_save`: a vision-language model's, models/vision_language.py)."""
    from ft_accum.models.lora import apply_lora as apply

    return apply(
        model,
        lora_settings(task_args),
        gradient_checkpointing=args.gradient_checkpointing,
        model_dtype=args.model_dtype,
        target_modules=target_modules,
        modules_to_save=modules_to_save,
    )


def fit_fsdp_units(accelerator, model) -> None:
    """Under FSDP, settle which modules Accelerate 1.15 shards as one unit, so that the model
    prepares; elsewhere, nothing. Call it after building the model, before the optimizer sees it.

    Accelerate (`fsdp2_prepare_model`) shards each `_no_split_modules` class, then the input
    embedding alone (with the output layer when the two are tied), then the rest as the root. Two
    kinds of model die in it with a traceback from deep inside torch:
    - BERT lists `BertEmbeddings`, the input embedding's parent: the embedding's weight is sharded
      once with it and again alone, and the second time is taken for a tensor-parallel DTensor
      (`DeviceMesh._concatenate`: "value was None"). The classes that hold the embedding are
      left out of the list; the embedding still gets its unit.
    - A weight shared by other modules than the input and output embeddings (T5's `shared` with
      both stacks' `embed_tokens`; a warm-started encoder-decoder's decoder embedding and output
      layer) would sit in two units ("shared with a parameter already managed by another FSDP
      group"). Those modules are sharded here as one unit, which Accelerate then skips, as torch
      asks: `fully_shard([module_a, module_b])`. Where one of them holds another (BERT's LM head,
      whose bias is its output layer's), Accelerate would shard the inner one again: refused.
      Accelerate's loading of the weights from rank 0 (`fsdp_cpu_ram_efficient_loading`) does not
      expect a unit made before its own, so it is off for such a model: every rank loaded the whole
      model already.

    A model without input embeddings (a ResNet) makes Accelerate raise NotImplementedError: it is
    refused, in one line that names DDP instead.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if accelerator.distributed_type != DistributedType.FSDP or isinstance(model, FSDPModule):
        return
    try:
        embedding = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        embedding = None
    if embedding is None:
        refuse_under_fsdp(
            accelerator, f"{type(model).__name__}, which has no input embeddings (not a transformer) to shard by"
        )
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    groups = [g for g in shared_weight_modules(model) if {id(m) for m in g} != {id(embedding), id(output)}]
    plugin = accelerator.state.fsdp_plugin
    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    if policy is transformer_auto_wrap_policy and not plugin.transformer_cls_names_to_wrap:
        inner = [embedding, *(m for g in groups for m in g)]
        holders = {type(m).__name__ for m in model.modules() if any(c is i for c in m.modules() for i in inner)}
        plugin.transformer_cls_names_to_wrap = sorted(set(getattr(model, "_no_split_modules", None) or ()) - holders)
    for group in groups:
        nested = [(a, b) for a in group for b in group if a is not b and any(c is b for c in a.modules())]
        if nested:  # Accelerate would shard the inner module again as its output layer
            names = {id(m): n for n, m in model.named_modules()}
            refuse_under_fsdp(
                accelerator,
                f"{type(model).__name__}: {names[id(nested[0][1])]} shares weights with modules around and beside it "
                f"({', '.join(names[id(m)] for m in group if m is not nested[0][1])}), which Accelerate's FSDP cannot "
                "place in one unit (a T5 or BART model has no such tie)",
            )
        # Unsharded from the first use (the embedding) to the last (the output layer), as Accelerate keeps its tail.
        fully_shard(group, reshard_after_forward=False, offload_policy=plugin.cpu_offload,
                    mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())  # fmt: skip
        plugin.cpu_ram_efficient_loading = False


def shared_weight_modules(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The groups of distinct modules that hold the same parameter objects (tied weights), in module
    order; ties that share a module are one group (a decoder embedding tied to an output layer whose
    bias is tied to its head's)."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(module)
    groups: list[set[int]] = []
    for modules in holders.values():
        if len(modules) > 1:
            group = {id(m) for m in modules}
            for other in [g for g in groups if g & group]:
                groups.remove(other)
                group |= other
            groups.append(group)
    return [[m for m in model.modules() if id(m) in group] for group in groups]


def refuse_under_fsdp(accelerator, what: str) -> None:
    """Under FSDP, the one-line refusal of a model it cannot serve, naming the config to use instead."""
    if accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError(
            f"FSDP cannot serve {what}; launch with accelerate_configs/multi_gpu_ddp.yaml (DDP: each GPU holds the "
            "whole model) or accelerate_configs/single_gpu_bf16.yaml"
        )
