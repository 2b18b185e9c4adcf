"""Command-line and YAML arguments for recipes, through `transformers.HfArgumentParser`.

Every recipe parses two dataclasses, the way `run_glue.py` parses its three: its own small
`TaskArguments` (data, columns, lengths, model) and the `TrainingArguments` below, which holds
everything the recipes share (batch, LR, schedule, checkpointing, the optional features) and
checks it once, in `__post_init__`.

`--config file.yaml` supplies defaults; flags on the command line override them. This order is
what users expect from `accelerate launch recipe.py --config base.yaml --learning_rate 1e-4`, and
it is why the YAML is applied with `set_defaults` instead of `HfArgumentParser.parse_yaml_file`
(which ignores the command line).
"""

from __future__ import annotations

import argparse
import contextvars
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TypeVar

from ft_accum.core.accumulation_schedule import parse_accumulation_schedule
from ft_accum.core.batch_arithmetic import BatchPlan
from ft_accum.core.early_stopping import greater_is_better
from ft_accum.core.errors import ConfigError, one_line_errors
from ft_accum.core.lr_scaling import POLICIES, scale_learning_rate
from ft_accum.training.recipe_files import config_of
from ft_accum.training.yaml_config import read_yaml_config

T = TypeVar("T")


OPTIMIZERS = ("adamw_torch", "adamw_8bit", "adamw_torch_8bit", "sgd")


@dataclass
class TrainingArguments:
    """What every recipe shares. Recipes change a default with `parse_args(..., learning_rate=2e-4)`."""

    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Micro-batch per process: what fits in memory."}
    )
    per_device_eval_batch_size: int = field(default=32, metadata={"help": "Evaluation batch per process."})
    gradient_accumulation_steps: Optional[int] = field(
        default=None, metadata={"help": "Micro-batches per update. Give this or --effective_batch_size."}
    )
    effective_batch_size: Optional[int] = field(
        default=None, metadata={"help": "Samples per optimizer update; the accumulation is derived from it."}
    )
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak LR, right at --base_batch_size."})
    base_batch_size: Optional[int] = field(
        default=None, metadata={"help": "Batch size --learning_rate was tuned for; unset = no scaling."}
    )
    lr_scaling: str = field(
        default="auto", metadata={"help": f"How the LR follows the effective batch: {', '.join(POLICIES)}."}
    )
    optim: str = field(
        default="adamw_torch",
        metadata={
            "help": "adamw_torch (fused), adamw_8bit (bitsandbytes' 8-bit AdamW states: 2 bytes per parameter instead "
            "of 8; needs the [lowmem] extra) or sgd (momentum 0.9)."
        },
    )
    lr_scheduler_type: str = field(
        default="linear", metadata={"help": "Any transformers scheduler name; its length is in optimizer updates."}
    )
    num_warmup_steps: int = field(default=0, metadata={"help": "Warmup length in optimizer updates."})
    weight_decay: float = field(default=0.01, metadata={"help": "Decoupled weight decay (not on biases and norms)."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Clip the window's gradient to this norm; 0 = no clipping."}
    )
    num_train_epochs: int = field(default=3, metadata={"help": "Passes over the training set."})
    max_train_steps: Optional[int] = field(
        default=None, metadata={"help": "Stop after this many optimizer updates (overrides epochs)."}
    )
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Use only the first N training rows."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Use only the first N evaluation rows."})
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in backward: less memory, ~30%% slower."}
    )
    model_dtype: str = field(
        default="float32",
        metadata={
            "help": "Dtype of the trained weights and so of their gradients and AdamW state. float32 (default) keeps "
            "fp32 master weights even for a bf16 checkpoint; bfloat16 halves that memory but loses every update "
            "smaller than 1/256 of a weight. A LoRA base is frozen in the mixed-precision dtype either way."
        },
    )
    offload_activations: bool = field(
        default=False,
        metadata={
            "help": "Move what the forward saves for backward (with --gradient_checkpointing: each block's input) "
            "to pinned host memory and back in backward: GPU memory for PCIe transfers. GPU only."
        },
    )
    torch_compile: bool = field(
        default=False,
        metadata={"help": "torch.compile each repeated block (regional compilation): faster steps, a slow first one."},
    )
    accumulation_schedule: Optional[str] = field(
        default=None,
        metadata={
            "help": 'Change the effective batch mid-run: "100:64,300:128" (from update 100, 300), "epoch1:64", or '
            '"adaptive[:max=256,factor=2,patience=10]" (doubles it while the noise scale exceeds factor × the batch; '
            "turns on --measure_noise_scale). The LR scaling is re-applied at each change."
        },
    )
    measure_noise_scale: bool = field(
        default=False,
        metadata={
            "help": "Log the gradient noise scale (McCandlish et al. 2018) per update and advise on the effective "
            "batch; needs accumulation ≥ 2."
        },
    )
    sync_each_batch: bool = field(
        default=False,
        metadata={
            "help": "Several processes: reduce gradients after every micro-batch, not only at the window's last. "
            "Less memory under FSDP (accelerate#2531), more communication; the update is the same."
        },
    )
    ddp_timeout: int = field(
        default=1800,
        metadata={
            "help": "Several processes: seconds a process waits in a collective operation (a checkpoint write on "
            "another, a process that stopped joining) before the run stops with an error. transformers' default."
        },
    )
    auto_micro_batch: bool = field(
        default=False,
        metadata={
            "help": "On out-of-memory, halve the micro-batch and double the accumulation (same effective batch and "
            "LR) and retry the update. One process only."
        },
    )
    seed: int = field(
        default=42, metadata={"help": "Seeds the init and the sample order (which does not depend on the split)."}
    )
    output_dir: str = field(default="outputs/run", metadata={"help": "Where final/, checkpoints/ and metrics go."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Replace the run already in --output_dir (refused otherwise)."}
    )
    checkpointing_steps: Optional[int] = field(
        default=None, metadata={"help": "Save a checkpoint every N optimizer updates."}
    )
    save_total_limit: Optional[int] = field(default=None, metadata={"help": "Keep only the newest K checkpoints."})
    resume_from_checkpoint: Optional[str] = field(
        default=None,
        metadata={
            "help": "A checkpoint folder; 'latest' under --output_dir; or 'auto': latest if there is one, else a "
            "fresh start (requeued jobs)."
        },
    )
    max_consecutive_skipped_updates: int = field(
        default=20, metadata={"help": "fp16: stop after this many updates in a row skipped for overflow; 0 = never."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run Python code shipped with the model. Only for models you trust."}
    )
    report_to: str = field(
        default="auto",
        metadata={
            "help": "tensorboard, wandb (offline unless WANDB_MODE says otherwise), mlflow (a SQLite store in "
            "--output_dir unless MLFLOW_TRACKING_URI), trackio, none, or auto (tensorboard when installed)."
        },
    )
    eval_steps: Optional[int] = field(
        default=None,
        metadata={
            "help": "Also evaluate every N optimizer updates (after an update, never inside one); epochs' ends always."
        },
    )
    metric_for_best_model: str = field(
        default="eval_loss",
        metadata={"help": "The evaluation metric that ranks evaluations, for early stopping and the best model."},
    )
    greater_is_better: Optional[bool] = field(
        default=None,
        metadata={
            "help": "Whether a larger --metric_for_best_model is better; unset: false for losses, perplexities, errors."
        },
    )
    early_stopping_patience: Optional[int] = field(
        default=None,
        metadata={
            "help": "Stop after this many evaluations in a row without improvement (a last checkpoint, then final/)."
        },
    )
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "An evaluation improves only when better than the best by more than this."}
    )
    load_best_model_at_end: bool = field(
        default=False,
        metadata={
            "help": "final/ holds the best evaluation's weights (each new best is checkpointed, never deleted)."
        },
    )

    def __post_init__(self):
        # Sizes are ≥ 1 here; how --gradient_accumulation_steps or --effective_batch_size split (and that only one
        # is given) is checked with the split itself, once the process count is known (BatchPlan.from_settings).
        require_at_least(
            self,
            1,
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "effective_batch_size",
            "per_device_eval_batch_size",
            "num_train_epochs",
            "max_train_steps",
            "checkpointing_steps",
            "save_total_limit",
            "max_train_samples",
            "max_eval_samples",
            "ddp_timeout",
            "eval_steps",
            "early_stopping_patience",
        )
        if self.learning_rate <= 0:
            raise ConfigError(f"--learning_rate must be > 0, got {self.learning_rate}")
        require_at_least(self, 0, "weight_decay", "max_grad_norm", "early_stopping_threshold")
        if self.greater_is_better is None:
            self.greater_is_better = greater_is_better(self.metric_for_best_model)
        if self.model_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"--model_dtype must be float32 or bfloat16, got {self.model_dtype!r}")
        if self.optim not in OPTIMIZERS:
            raise ConfigError(f"--optim must be one of {', '.join(OPTIMIZERS)}, got {self.optim!r}")
        # Imported where used: transformers' SchedulerType lives beside its Trainer utilities, which
        # import peft and bitsandbytes when installed; `ft-accum sweep` reads these settings without them.
        from accelerate.utils import LoggerType
        from transformers import SchedulerType

        schedulers = [s.value for s in SchedulerType]
        if self.lr_scheduler_type not in schedulers:
            raise ConfigError(
                f"--lr_scheduler_type must be one of {', '.join(schedulers)}, got {self.lr_scheduler_type!r}"
            )
        trackers = ["auto", "none", *(t.value for t in LoggerType)]
        if self.report_to not in trackers:
            raise ConfigError(f"--report_to must be one of {', '.join(trackers)}, got {self.report_to!r}")
        if self.lr_scaling not in POLICIES:
            raise ConfigError(f"--lr_scaling must be one of {', '.join(POLICIES)}, got {self.lr_scaling!r}")
        # Parsed here once (not a field: the parsed form is derived); run_setup hands it to the scheduler.
        self.parsed_schedule = parse_accumulation_schedule(self.accumulation_schedule)
        self.measure_noise_scale |= bool(self.parsed_schedule and self.parsed_schedule.unit == "adaptive")
        check_field_values(self)  # after the specific checks, whose messages say more

    def batch_plan(self, num_processes: int) -> BatchPlan:
        """micro × accumulation × processes for this run (see batch_arithmetic)."""
        return BatchPlan.from_settings(
            self.per_device_train_batch_size,
            num_processes,
            self.gradient_accumulation_steps,
            self.effective_batch_size,
        )

    def scaled_learning_rate(self, effective_batch_size: int) -> float:
        """--learning_rate moved from --base_batch_size to `effective_batch_size` (see lr_scaling)."""
        return scale_learning_rate(
            self.learning_rate, effective_batch_size, self.base_batch_size, self.lr_scaling, self.optim
        )


@dataclass
class LoraArguments:
    """The LoRA flags of every recipe that trains language models: its `TaskArguments` inherits them
    (`class TaskArguments(LoraArguments)`), so each variant peft offers is parsed and checked once."""

    use_lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights (peft)."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "Comma-separated names, or all-linear."})
    use_rslora: bool = field(
        default=False, metadata={"help": "rsLoRA: scale alpha / sqrt(r), stable at high ranks (arXiv:2312.03732)."}
    )
    use_dora: bool = field(
        default=False,
        metadata={"help": "DoRA: train each weight's magnitude and direction apart (arXiv:2402.09353); slower."},
    )
    loraplus_lr_ratio: Optional[float] = field(
        default=None,
        metadata={"help": "LoRA+: the B matrices learn this many times faster than A (arXiv:2402.12354; 16 there)."},
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "QLoRA: freeze the base in NF4 4-bit weights, train LoRA adapters (needs --use_lora, [lowmem])."
        },
    )

    def __post_init__(self):
        for name in ("lora_r", "lora_alpha"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be ≥ 1, got {getattr(self, name)}")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.loraplus_lr_ratio is not None and not self.loraplus_lr_ratio >= 1:
            raise ConfigError(f"--loraplus_lr_ratio is B's LR over A's, ≥ 1; got {self.loraplus_lr_ratio}")
        variants = [f"--{name}" for name in ("use_rslora", "use_dora") if getattr(self, name)]
        variants += ["--loraplus_lr_ratio"] if self.loraplus_lr_ratio is not None else []
        if variants and not self.use_lora:
            raise ConfigError(f"{', '.join(variants)} is a LoRA variant, so it needs --use_lora")
        if self.load_in_4bit and not self.use_lora:
            raise ConfigError(
                "--load_in_4bit freezes the base in 4 bits, so only LoRA adapters can train; add --use_lora"
            )
        next_post_init(LoraArguments, self)


@dataclass
class LabelSmoothingArguments:
    """--label_smoothing, for the recipes whose loss is a cross-entropy over classes or tokens: their
    `TaskArguments` inherit it and pass it to the loss (training only; evaluation reports the plain loss)."""

    label_smoothing: float = field(
        default=0.0,
        metadata={
            "help": "ε of label-smoothed cross-entropy: (1 − ε) on the target, ε spread over all classes (Szegedy et "
            "al. 2016); summed over the targets and divided once by the window's count, as the plain loss. Training only."
        },
    )

    def __post_init__(self):
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"--label_smoothing must be in [0, 1), got {self.label_smoothing}")
        next_post_init(LabelSmoothingArguments, self)


@dataclass
class NEFTuneArguments:
    """--neftune_noise_alpha, for the recipes that train a language model on text: their `TaskArguments`
    inherit it and hand it to `run_setup.start_training` (models/neftune.py)."""

    neftune_noise_alpha: Optional[float] = field(
        default=None,
        metadata={
            "help": "NEFTune (arXiv:2310.05914): uniform noise on the input embeddings while training, α/√(L·d) with "
            "L each row's own length, on real tokens only, the same at any split of the batch. 5 in the paper."
        },
    )

    def __post_init__(self):
        if self.neftune_noise_alpha is not None and not self.neftune_noise_alpha > 0:
            raise ConfigError(f"--neftune_noise_alpha must be > 0 (5 in the paper), got {self.neftune_noise_alpha}")
        next_post_init(NEFTuneArguments, self)


def next_post_init(cls: type, instance) -> None:
    """The `__post_init__` after `cls`'s in `instance`'s classes, if any: argument mixins combine
    (`class TaskArguments(LoraArguments, LabelSmoothingArguments)`) and each checks its own fields."""
    following = getattr(super(cls, instance), "__post_init__", None)
    if following is not None:
        following()


def parse_args(
    task_class: type[T],
    argv: list[str] | None = None,
    description: str | None = None,
    default_config: Path | None = None,
    **recipe_defaults,
) -> tuple[T, TrainingArguments]:
    """Parse `argv` (default: sys.argv[1:]) into (task_class, TrainingArguments).

    Precedence, lowest first: the dataclass defaults, `recipe_defaults`, the YAML config, the command
    line. The config is `--config FILE`, else `default_config` (the recipe's own
    recipes/configs/<name>.yaml), so a run with no flags is the run its docstring describes;
    `--config none` leaves every value at its dataclass default. A command-line
    --gradient_accumulation_steps or --effective_batch_size replaces the config's other one (the two
    are one setting, and giving both is an error).
    """
    classes = (task_class, TrainingArguments)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)

    # Keep the recipe docstring's line breaks (its first line is the launch command) and show defaults.
    formatter = type(
        "HelpFormatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {}
    )
    from transformers import HfArgumentParser

    # allow_abbrev=False: a typo'd or shortened flag is an error, never silently another flag.
    parser = HfArgumentParser(classes, description=description, formatter_class=formatter, allow_abbrev=False)
    parser.add_argument(
        "--config",
        default=None,
        help="YAML file of settings; command-line flags override it. Default: the recipe's recipes/configs/<name>.yaml "
        "if it exists; 'none' for none",
    )
    parser.error = _one_line_error  # argparse prints usage and a message over several lines
    parser.set_defaults(**recipe_defaults)
    config = known.config if known.config is not None else default_config
    if config and str(config).lower() != "none" and (known.config is not None or Path(config).is_file()):
        values = read_yaml_config(config, *classes)
        given = {a.split("=")[0].lstrip("-") for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
        split = {"gradient_accumulation_steps", "effective_batch_size"}
        if given & split:
            values = {k: v for k, v in values.items() if k not in split - given}
        parser.set_defaults(**values)
    # The outputs: the two dataclasses, a namespace holding --config, and the strings nobody took.
    task_args, training_args, *_, unknown = parser.parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True
    )
    if unknown:
        raise ConfigError(f"unknown argument(s) {' '.join(unknown)}; see --help for the settings")
    check_field_values(task_args)  # TrainingArguments checks itself in __post_init__
    return task_args, training_args


def check_field_values(config) -> None:
    """Rules that hold for every field of every recipe: a whole number is never negative (sizes, counts,
    steps, seeds) and a real number is finite. Field-specific minimums live in each `__post_init__`."""
    for name in typing.get_type_hints(type(config)):
        value = getattr(config, name)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int) and value < 0:
            raise ConfigError(f"--{name} must be ≥ 0, got {value}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{name} must be a finite number, got {value}")


def _one_line_error(message: str):
    raise ConfigError(f"{message}; see --help")


# Set by `recipe_modules.recipe_arguments`: a recipe's `main` then returns its parsed arguments instead of training.
PARSE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("PARSE_ONLY", default=False)


def run_main(train, task_class: type, argv: list[str] | None, description: str | None, **recipe_defaults):
    """A recipe's `main`: parse and train, with input errors as one `error:` line (errors.one_line_errors).
    The output folder's lock (run_outputs.lock_output_dir) is released however it ends, and the
    process group after train()'s locals (process_group_teardown: a deadlock otherwise)."""
    from ft_accum.training.collective_timeout import collective_failures
    from ft_accum.training.process_group_teardown import release_process_group
    from ft_accum.training.run_outputs import release_output_locks

    recipe = Path(train.__code__.co_filename)
    try:
        with one_line_errors(), collective_failures():
            default_config = config_of(recipe)
            parsed = parse_args(task_class, argv, description, default_config, **recipe_defaults)
            return parsed if PARSE_ONLY.get() else train(*parsed)
    finally:
        release_output_locks()
        release_process_group()


def require_at_least(config, minimum: int, *names: str) -> None:
    """Each named setting that is set (not None) must be ≥ `minimum`: zero or negative sizes are typos."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name} must be ≥ {minimum}, got {value}")
