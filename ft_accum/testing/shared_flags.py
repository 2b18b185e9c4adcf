"""The shared training flags (ft_accum/training/arguments.py: `TrainingArguments`), each with how a run
on a CPU shows that a recipe honoured it: the table behind docs/shared_flags.md and
tests/test_shared_flags.py.

A recipe accepts every shared flag (`--help` lists them all), so each must change what runs or stop
the run with one `error:` line (DEVELOPERS.md). `TRIALS` holds the flags a one-update run on a tiny
model can show: a value unlike the default, and what the run must show for it, read from what the run
did (`Observed`: the optimizer's saved state, the logged LR, the arguments it passed to torch), not
from the banner, which prints the arguments whatever the loop does. They are tried together in one
run (`try_shared_flags`), each observation independent of the others; a flag the recipe refuses is
dropped and the rest run again. `NOT_TRIED` says, for every other flag, why one CPU process at one
update cannot show it and which test covers it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

# The tiny run every trial shares: 48 rows (the labels of 4 evaluation rows all among them), one update of
# 8 as 2 micro-batches of 4, 4 evaluation rows, a checkpoint after it (the optimizer state is read from it).
BASE_FLAGS = ["--max_train_steps", "1", "--max_train_samples", "48", "--max_eval_samples", "4",
              "--per_device_train_batch_size", "4", "--effective_batch_size", "8", "--report_to", "none",
              "--checkpointing_steps", "1"]  # fmt: skip


@dataclasses.dataclass
class Observed:
    """What one run did, as the probes of `observing` and its output folder recorded it."""

    output_dir: Path
    manual_seeds: list[int] = dataclasses.field(default_factory=list)  # torch.manual_seed's arguments
    clip_norms: list[float] = dataclasses.field(default_factory=list)  # max_norm of each gradient clipping
    compiled: int = 0  # torch.compile calls (what nn.Module.compile makes)
    recomputed: int = 0  # module forwards run inside backward: activations recomputed
    loader_batch_sizes: list[int] = dataclasses.field(default_factory=list)  # each DataLoader's batch_size
    selected: list[int] = dataclasses.field(default_factory=list)  # rows of each datasets.Dataset.select
    eval_rows: list[int] = dataclasses.field(default_factory=list)  # rows of each model call while evaluating

    # Read once, after the run: several trials look at each.
    @functools.cached_property
    def records(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []

    @functools.cached_property
    def results(self) -> dict:
        path = self.output_dir / "all_results.json"
        return json.loads(path.read_text()) if path.exists() else {}

    @functools.cached_property
    def optimizer_state(self) -> dict:
        import torch

        path = self.output_dir / "checkpoints" / "step_000001" / "optimizer.bin"
        return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else {}

    def final_dtypes(self) -> set[str]:
        """safetensors' names of the dtypes in final/ (F32, BF16, ...)."""
        from safetensors import safe_open

        dtypes = set()
        for file in (self.output_dir / "final").glob("*.safetensors"):
            with safe_open(str(file), "pt") as weights:
                dtypes |= {str(weights.get_slice(name).get_dtype()) for name in weights.keys()}
        return dtypes


@dataclasses.dataclass(frozen=True)
class Trial:
    flags: tuple[str, ...]  # the flag and its trial value
    shows: str  # what the run shows when the flag is honoured
    honoured: Callable[[Observed], bool]


def _lr_is(expected: float) -> Callable[[Observed], bool]:
    return lambda seen: bool(seen.records) and abs(seen.records[0]["lr"] - expected) <= 1e-9 * expected


def _param_groups(seen: Observed) -> list[dict]:
    return seen.optimizer_state.get("param_groups", [])


def _moments(seen: Observed) -> set[str]:
    return {key for state in seen.optimizer_state.get("state", {}).values() for key in state}


# One LR observation holds four flags: 0.00123 × 8 / 4 (linear scaling to the effective batch of 8 from
# a base of 4), constant: 0.00246 after the update. Ignoring any one of them gives another number
# (the default linear schedule decays to 0 at the run's one update; no scaling leaves 0.00123).
TRIALS = [
    Trial(("--learning_rate", "0.00123"), "the logged LR of update 1 is 0.00123 × 8/4", _lr_is(0.00246)),
    Trial(("--lr_scaling", "linear"), "(the same LR)", _lr_is(0.00246)),
    Trial(("--base_batch_size", "4"), "(the same LR)", _lr_is(0.00246)),
    Trial(("--lr_scheduler_type", "constant"), "(the same LR, not decayed to 0)", _lr_is(0.00246)),
    Trial(("--optim", "sgd"), "the checkpoint's optimizer state is SGD's momentum", lambda s: _moments(s) == {"momentum_buffer"}),
    Trial(("--weight_decay", "0.0123"), "a parameter group of the checkpoint's optimizer decays by 0.0123",
          lambda s: any(g.get("weight_decay") == 0.0123 for g in _param_groups(s))),
    Trial(("--max_grad_norm", "0.0123"), "the gradient is clipped to 0.0123", lambda s: 0.0123 in s.clip_norms),
    Trial(("--seed", "4321"), "torch.manual_seed(4321)", lambda s: 4321 in s.manual_seeds),
    Trial(("--gradient_checkpointing", "true"), "modules run forward again inside backward", lambda s: s.recomputed > 0),
    Trial(("--model_dtype", "bfloat16"), "final/ holds bfloat16 weights", lambda s: "BF16" in s.final_dtypes()),
    Trial(("--torch_compile", "true"), "torch.compile is called", lambda s: s.compiled > 0),
    Trial(("--offload_activations", "true"), "nothing on a CPU: it must be refused", lambda s: False),
    Trial(("--measure_noise_scale", "true"), "metrics.jsonl has the noise-scale columns",
          lambda s: bool(s.records) and any("noise" in key for key in s.records[0])),
    Trial(("--report_to", "tensorboard"), "TensorBoard event files in --output_dir",
          lambda s: any(s.output_dir.rglob("events.out.tfevents.*"))),
    # 3 evaluation rows in batches of 2: a model call of 3 rows means the batch size was ignored.
    Trial(("--per_device_eval_batch_size", "2"), "a DataLoader of batches of 2, or evaluation calls of ≤ 2 rows",
          lambda s: 2 in s.loader_batch_sizes or max(s.eval_rows, default=0) == 2),
    Trial(("--max_train_samples", "40"), "a 40-row dataset is selected", lambda s: 40 in s.selected),
    Trial(("--max_eval_samples", "3"), "a 3-row dataset is selected", lambda s: 3 in s.selected),
    Trial(("--metric_for_best_model", "eval_loss"), "all_results.json's best_metric is its eval_loss",
          lambda s: s.results.get("best_metric") is not None and s.results.get("best_metric") == s.results.get("eval_loss")),
]  # fmt: skip

# Every other shared flag, with why one CPU process at one update cannot show it, and where it is tested.
NOT_TRIED = {
    "per_device_train_batch_size": "the split itself: ft-accum check runs every recipe at (8 × 1) and (2 × 4)",
    "gradient_accumulation_steps": "the split itself: ft-accum check (tests/test_recipe_contract.py)",
    "effective_batch_size": "the split itself: ft-accum check (tests/test_recipe_contract.py)",
    "num_warmup_steps": "inside a warm-up every --lr_scheduler_type gives the same LR at update 1, so trying it would hide that flag; tests/test_accumulation_schedule.py",
    "num_train_epochs": "the trials stop at --max_train_steps 1; the engines and DDP tests run whole epochs",
    "max_train_steps": "every trial run is cut by it (one update, one metrics line)",
    "accumulation_schedule": "changes the batch only from a later update: tests/test_accumulation_schedule.py",
    "sync_each_batch": "several processes only: tests/test_scale_out.py",
    "ddp_timeout": "several processes only: tests/test_every_rank.py, tests/test_engines.py",
    "auto_micro_batch": "acts on an out-of-memory error only: tests/test_text_classification.py",
    "output_dir": "every trial run writes to it",
    "overwrite_output_dir": "a second run into the same folder: tests/test_bad_inputs.py",
    "checkpointing_steps": "every trial run checkpoints at update 1 (the optimizer state is read from it)",
    "save_total_limit": "needs two checkpoints: tests/test_checkpointing.py",
    "resume_from_checkpoint": "ft-accum check resumes every recipe (tests/test_recipe_contract.py)",
    "max_consecutive_skipped_updates": "fp16 overflow, a GPU's: tests/test_loss_normalization.py",
    "trust_remote_code": "a hub model's own code: nothing offline has any",
    "eval_steps": "one update shows no second evaluation: tests/test_trainer_options.py",
    "greater_is_better": "one evaluation is always the best: tests/test_trainer_options.py",
    "early_stopping_patience": "stops only after several evaluations: tests/test_trainer_options.py",
    "early_stopping_threshold": "(the same): tests/test_trainer_options.py",
    "load_best_model_at_end": "needs a later, worse evaluation: tests/test_trainer_options.py",
}

ERROR_FLAG = re.compile(r"--([a-z_0-9]+)")


@contextlib.contextmanager
def observing(output_dir: Path):
    """Record, for the run inside the block, what it asked torch to do (see `Observed`). The probes
    record and pass through, except torch.compile, which records and returns the function uncompiled
    (a CPU compile of each block takes minutes; tests/test_torch_compile.py runs the real one)."""
    import datasets
    import torch

    from ft_accum.training import collective_timeout

    seen = Observed(Path(output_dir))
    manual_seed, clip_grad_norm_ = torch.manual_seed, torch.nn.utils.clip_grad_norm_
    select, loader_init = datasets.Dataset.select, torch.utils.data.DataLoader.__init__

    def seeding(seed):
        seen.manual_seeds.append(int(seed))
        return manual_seed(seed)

    def clipping(parameters, max_norm, *args, **kwargs):
        seen.clip_norms.append(float(max_norm))
        return clip_grad_norm_(parameters, max_norm, *args, **kwargs)

    def compiling(model=None, *args, **kwargs):
        seen.compiled += 1
        return model if model is not None else (lambda fn: fn)

    def selecting(self, indices, *args, **kwargs):
        selected = select(self, indices, *args, **kwargs)
        seen.selected.append(len(selected))
        return selected

    def loading(self, dataset, batch_size=1, *args, **kwargs):
        seen.loader_batch_sizes.append(batch_size)
        loader_init(self, dataset, batch_size, *args, **kwargs)

    depth = [0]  # nesting of module calls: 0 is a model called from outside any module

    def enter(module, args):
        depth[0] += 1

    def leave(module, args, *kwargs_output):
        # After an exception torch calls an always-called hook with (module, args, output), kwargs or not:
        # non-reentrant checkpointing stops its recomputation with one.
        kwargs = kwargs_output[0] if len(kwargs_output) == 2 else {}
        depth[0] -= 1
        if depth[0] == 0 and collective_timeout.POSITION.phase == "eval":  # start_run rebinds it
            rows = [len(v) for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim()]
            seen.eval_rows += rows[:1]
        # -1 outside backward: a forward inside one is checkpointing's recomputation (no public test exists).
        if torch._C._current_graph_task_id() != -1:
            seen.recomputed += 1

    probes = [
        (torch, "manual_seed", seeding),
        (torch.nn.utils, "clip_grad_norm_", clipping),
        (torch, "compile", compiling),
        (datasets.Dataset, "select", selecting),
        (torch.utils.data.DataLoader, "__init__", loading),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, probe in probes:
            stack.enter_context(mock.patch.object(owner, name, probe))
        hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(enter),
            torch.nn.modules.module.register_module_forward_hook(leave, with_kwargs=True, always_call=True),
        ]
        stack.callback(lambda: [hook.remove() for hook in hooks])
        yield seen


@dataclasses.dataclass
class FlagReport:
    refused: dict[str, str]  # flag → its error line
    honoured: list[str]
    ignored: list[str]  # accepted, and the run showed nothing of it
    failure: str | None = None  # a run that failed without naming a tried flag


def try_shared_flags(run: Callable[[list[str]], Any], work: Path) -> FlagReport:
    """Run `run(argv)` (a recipe's in-process run, returning its SystemExit or None) with every trial's flag
    at once, under `observing`; a refused flag (named in the `error:` line) is dropped and the rest run
    again. Then each trial is honoured, refused, or ignored."""
    trials = list(TRIALS)
    report = FlagReport(refused={}, honoured=[], ignored=[])
    for attempt in range(len(trials) + 1):
        output_dir = work / f"attempt_{attempt}"
        tried = {t.flags[0] for t in trials}
        argv = [*BASE_FLAGS, "--output_dir", str(output_dir)]
        argv += [part for trial in trials for part in trial.flags]
        with observing(output_dir) as seen:
            outcome = run(argv)
        if outcome is None or outcome.code in (0, None):
            break
        message = str(outcome.code)
        # The first flag the line names is the one refused; later ones are the fix it suggests.
        named = next((f"--{name}" for name in ERROR_FLAG.findall(message) if f"--{name}" in tried), None)
        refused = [t for t in trials if t.flags[0] == named]
        if not message.startswith("error: ") or "\n" in message or not refused:
            report.failure = message[-2000:]
            return report
        report.refused |= {t.flags[0]: message for t in refused}
        trials = [t for t in trials if t not in refused]
    for trial in trials:
        (report.honoured if trial.honoured(seen) else report.ignored).append(trial.flags[0])
    return report
