"""The running state of a training loop: what a checkpoint saves and a resume restores.

One dataclass instead of a dict of strings, so a typo is an AttributeError, not a silent new key.
`training_state.json` in each checkpoint holds its fields (see checkpointing), next to the run
signature of issue 8 that refuses a resume which would change the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ft_accum.core.batch_arithmetic import BatchPlan
from ft_accum.core.early_stopping import improves, is_new_best, metric_key
from ft_accum.core.errors import register_progress_bar
from ft_accum.core.loss_normalization import check_skipped_updates
from ft_accum.training import checkpointing, collective_timeout
from ft_accum.training.model_card import is_exportable_causal_lm, write_model_card
from ft_accum.training.process_group_teardown import end_training
from ft_accum.training.run_outputs import log_evaluation, log_update, save_final, truncate_metrics, write_results


@dataclass
class TrainingState:
    """Counters of a run, all of them per run except `epoch_samples` (this process's)."""

    effective_batch_size: int  # of the current update; an accumulation schedule changes it
    step: int = 0  # completed optimizer updates
    epoch: int = 0
    epoch_samples: int = 0  # this process's samples of `epoch` consumed so far (where a resume re-enters it)
    scheduler_steps: int = 0  # LR-scheduler steps: = step, except under an adaptive schedule
    last_change: int = 0  # the update at which the effective batch last changed
    samples_seen: int = 0
    tokens_seen: int = 0
    items_seen: float = 0  # what the loss is a mean over (samples, target tokens, ...), summed over the updates
    train_seconds: float = 0.0
    skipped_updates: int = 0  # fp16 overflow
    consecutive_skipped: int = 0
    noise_scale_ema: Optional[dict] = None
    eval_metrics: Optional[dict] = None  # the last evaluation's numbers: a run resumed at its end still reports them
    best_metric: Optional[float] = None  # the best evaluation's --metric_for_best_model so far
    best_step: Optional[int] = None  # the update it followed
    evaluations_without_improvement: int = 0  # early stopping's patience counter
    stopped_early_at: Optional[int] = None  # the update after which early stopping ended the run
    last_checkpoint: Optional[str] = None

    def complete_update(self, window, skipped: bool, max_consecutive_skipped_updates: int) -> None:
        """Count one optimizer update (a `training.windows.Window`); stop the run when fp16 has skipped
        too many in a row."""
        self.step += 1
        self.scheduler_steps += window.lr_steps
        self.epoch_samples = window.epoch_samples
        summary = window.summary()
        self.samples_seen += int(summary["samples"])
        self.tokens_seen += int(summary["tokens"])
        self.items_seen += summary["items"]
        self.skipped_updates += skipped
        self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0
        check_skipped_updates(
            self.consecutive_skipped, max_consecutive_skipped_updates, self.step, self.last_checkpoint
        )

    def record(self, window, grad_norm: float, learning_rate: float, seconds: float, **extra: Any) -> dict[str, Any]:
        """The metrics.jsonl line of the update just completed."""
        return {
            "step": self.step,
            "epoch": window.epoch_progress,
            "loss": window.summary()["loss"],
            "lr": learning_rate,
            "grad_norm": grad_norm,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "samples_per_second": window.summary()["samples"] / seconds,
            "tokens_per_second": window.summary()["tokens"] / seconds,
            "skipped_updates": self.skipped_updates,
            "per_device_train_batch_size": window.plan.micro,
            "gradient_accumulation_steps": window.plan.accumulation,
            "effective_batch_size": self.effective_batch_size,
            **extra,
        }

    def change_effective_batch(self, effective_batch_size: int) -> None:
        """From this update on, the accumulation schedule's `effective_batch_size` (a change is remembered)."""
        if effective_batch_size != self.effective_batch_size:
            self.effective_batch_size, self.last_change = effective_batch_size, self.step

    def next_epoch(self) -> None:
        self.epoch += 1
        self.epoch_samples = 0

    def to_checkpoint(self, signature: dict[str, Any]) -> dict[str, Any]:
        """What `checkpointing.save_checkpoint` writes beside the step (which names the folder)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "step"} | {"signature": signature}

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any], checkpoint_name: str) -> TrainingState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in names} | {"last_checkpoint": checkpoint_name})


def start_or_resume(
    accelerator,
    model,
    plan: BatchPlan,
    *,
    seed: int,
    optim: str,
    accumulation_schedule: str | None,
    resume_from_checkpoint: str | None,
    output_dir: str,
) -> tuple[TrainingState, dict[str, Any]]:
    """(state, run signature): a fresh state, or the one of `--resume_from_checkpoint` after its model,
    optimizer, scheduler and RNG states are loaded. A checkpoint whose signature differs from this
    run's is refused (checkpointing.check_resume_signature); metrics.jsonl loses the lines of the
    updates that will run again."""
    signature = checkpointing.run_signature(
        accelerator.unwrap_model(model),
        effective_batch_size=plan.effective,
        per_device_train_batch_size=plan.micro,
        gradient_accumulation_steps=plan.accumulation,
        num_processes=plan.processes,
        seed=seed,
        optim=optim,
        accumulation_schedule=accumulation_schedule,
        mixed_precision=accelerator.mixed_precision,
    )
    state = TrainingState(effective_batch_size=plan.effective)
    if resume_from_checkpoint:
        saved = checkpointing.resume_training_state(accelerator, resume_from_checkpoint, output_dir, signature)
        state = TrainingState.from_checkpoint(saved, checkpointing.checkpoint_name(saved["step"]))
    if accelerator.is_main_process:
        truncate_metrics(Path(output_dir), state.step)
    return state, signature


class TrainClock:
    """Training seconds, with evaluation and checkpoint saving left out (`paused`), and the
    seconds of each update (`lap`) for the throughput columns of metrics.jsonl."""

    def __init__(self, already: float = 0.0):
        self._started = time.perf_counter() - already
        self._lap = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or pause)."""
        now = time.perf_counter()
        seconds, self._lap = now - self._lap, now
        return seconds

    @contextlib.contextmanager
    def paused(self):
        before = time.perf_counter()
        try:
            yield
        finally:
            after = time.perf_counter()
            self._started += after - before
            self._lap = after

    def total(self) -> float:
        return time.perf_counter() - self._started


def save_checkpoint(
    accelerator,
    output_dir: str | Path,
    state: TrainingState,
    signature: dict[str, Any],
    save_total_limit: int | None,
    train_seconds: float,
) -> Path:
    """An atomic checkpoint at this sync step (see checkpointing.save_checkpoint); remembers its name
    for the error messages that point the user to the last good one."""
    state.train_seconds = train_seconds
    best = checkpointing.checkpoint_name(state.best_step) if state.best_step is not None else None
    path = checkpointing.save_checkpoint(
        accelerator, output_dir, state.step, state.to_checkpoint(signature), save_total_limit, keep=best
    )
    state.last_checkpoint = str(path)
    return path


RESUME_COMMAND_FILE = "resume_command.txt"


@dataclass(frozen=True)
class BestModelSettings:
    """How evaluations are ranked and when they stop the run (--metric_for_best_model and the rest; their
    defaults are TrainingArguments', run_setup.start_training builds it)."""

    metric: str
    greater_is_better: bool
    patience: Optional[int]  # None: never stop early
    threshold: float
    load_at_end: bool


@dataclass(frozen=True)
class RunSettings:
    """What a run's bookkeeping needs of its arguments (run_setup.run_settings builds it)."""

    output_dir: str
    checkpointing_steps: Optional[int]
    save_total_limit: Optional[int]
    max_consecutive_skipped_updates: int
    scaled_learning_rate: Callable[[int], float]  # the peak LR for an effective batch (--lr_scaling)
    best_model: BestModelSettings


class RunTracker:
    """What happens once per update besides the update itself: the counters, metrics.jsonl and the
    tracker, the progress bar, checkpoints, and the graceful stop; and the end of the run.

    `end_update` is the recipe's one call after each update, and `evaluate` its call at each epoch's
    end. `stop` is a `GracefulStop` (or None to do without); its resume command goes to
    `RESUME_COMMAND_FILE` in the output folder. run_setup.start_training builds it.
    """

    def __init__(
        self,
        accelerator,
        settings: RunSettings,
        state: TrainingState,
        signature: dict[str, Any],
        num_update_steps: int,
        stop=None,
        *,
        lr_scheduler,
        train_windows,
    ):
        from tqdm.auto import tqdm

        self.accelerator, self.settings, self.state, self.signature = accelerator, settings, state, signature
        self.stop = stop
        # The logged LR is the one each update leaves; the final plan is the windows' (an out-of-memory
        # re-split changes it mid-run).
        self.lr_scheduler, self.train_windows = lr_scheduler, train_windows
        self.evaluation: dict[str, Any] = {}  # the last evaluation's metrics, whole
        self.initial_evaluation: dict[str, Any] = {}  # evaluate_before_training's, all_results.json's initial_*
        self.noise = None  # the NoiseScaleMeter of the windows, once an update has been measured
        # A checkpoint (or stop) due at an epoch's last update waits for its evaluation (`log_evaluation`).
        self.pending, self.stopping = False, False
        self.num_update_steps = num_update_steps
        self.clock = TrainClock(state.train_seconds)
        position = collective_timeout.POSITION  # what a stuck collective's error line reports
        position.phase, position.updates_done = "train", state.step
        position.last_checkpoint, position.resume_command = state.last_checkpoint, stop.command if stop else None
        if stop is not None and accelerator.is_main_process:
            # Written at the start, so a run killed without warning (SIGKILL, power) has it too.
            (Path(settings.output_dir) / RESUME_COMMAND_FILE).write_text(stop.command + "\n")
        self.progress = tqdm(
            total=num_update_steps,
            initial=state.scheduler_steps,
            desc="updates",
            disable=not accelerator.is_local_main_process,
        )
        register_progress_bar(self.progress)

    def end_update(self, window, *, grad_norm, **columns: Any) -> None:
        """After the update: count it (a `training.windows.Window`), log its record (`grad_norm` before
        clipping, the LR the update leaves; `columns` are extra metrics.jsonl columns, the noise scale's
        added when it is measured), checkpoint when due or when a signal asks to stop (which then ends
        the process). The windows end the run themselves after its last update."""
        state, settings = self.state, self.settings
        grad_norm = float(grad_norm)
        skipped = self.accelerator.optimizer_step_was_skipped
        state.complete_update(window, skipped, settings.max_consecutive_skipped_updates)
        if window.noise is not None:
            self.noise = window.noise
            state.noise_scale_ema, noise_columns = window.noise.at_sync(
                self.accelerator,
                grad_norm=grad_norm,
                window_items=window.summary()["items"],
                ema=state.noise_scale_ema,
            )
            columns |= noise_columns
        collective_timeout.POSITION.updates_done = state.step
        learning_rate = float(self.lr_scheduler.get_last_lr()[0])
        record = state.record(window, grad_norm, learning_rate, self.clock.lap(), **columns)
        log_update(self.accelerator, settings.output_dir, record, self.progress, window.lr_steps)
        stopping = (self.stop is not None and self.stop.requested(self.accelerator)) or (
            self.pending and self.stopping
        )
        due = self.pending or bool(settings.checkpointing_steps and state.step % settings.checkpointing_steps == 0)
        self.pending = False
        if window.evaluation_due and (stopping or due):
            # After the update's evaluation (`log_evaluation`), so that a resume from it has nothing left to do.
            self.pending, self.stopping = True, stopping
        elif stopping or due:
            self.save(stopping)

    def save(self, stopping: bool) -> None:
        """A checkpoint now (see `save_checkpoint`); after a stop signal, then the end of the process."""
        with self.clock.paused(), collective_timeout.phase("save"):
            path = save_checkpoint(
                self.accelerator,
                self.settings.output_dir,
                self.state,
                self.signature,
                self.settings.save_total_limit,
                self.clock.total(),
            )
        collective_timeout.POSITION.last_checkpoint = str(path)
        if stopping:
            self.stop.exit(self.accelerator, path)

    def evaluate_before_training(self, evaluate: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict:
        """`evaluate(*args, **kwargs)` before the first update, outside the training time: the baseline,
        printed and kept for all_results.json (`initial_eval_*`) and the model card's "before training"
        column. A --metric_for_best_model it does not hold is refused here, in one line, not after the
        training up to the first evaluation."""
        with self.paused():
            metrics = evaluate(*args, **kwargs)
        metric_key(self.settings.best_model.metric, metrics)
        self.initial_evaluation = metrics
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.accelerator.print("before training: " + ", ".join(f"{k} {v:.4g}" for k, v in numbers.items()))
        return metrics

    def evaluate(self, evaluate: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`evaluate(*args, **kwargs)` at an epoch's end, outside the training time (`paused`), then on record
        (`log_evaluation`); returns its metrics."""
        with self.paused():
            metrics = evaluate(*args, **kwargs)
        self.log_evaluation(metrics)
        return metrics

    def log_evaluation(self, metrics: dict[str, Any]) -> None:
        """The evaluation on record (run_outputs.log_evaluation) and in the training state, ranked (`rank`);
        then the checkpoint (or the stop) that its update deferred to this point, or the one a new best
        (--load_best_model_at_end) or early stopping asks for. Early stopping ends the windows: the
        loop ends, and `finish` writes the outputs of a finished run."""
        self.evaluation = metrics
        log_evaluation(self.accelerator, epoch=self.state.epoch, step=self.state.step, metrics=metrics)
        self.state.eval_metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}
        new_best, stop_early = self.rank(metrics)
        if self.pending or stop_early or (new_best and self.settings.best_model.load_at_end):
            stopping, self.pending = self.pending and self.stopping, False
            self.save(stopping)

    def rank(self, metrics: dict[str, Any]) -> tuple[bool, bool]:
        """(a new best, stop early) after an evaluation (core/early_stopping's rules), with the best and
        the patience counter kept in the training state (so in each checkpoint). The main process's
        value decides, so every process makes the same decision."""
        from accelerate.utils import broadcast_object_list

        rules, state = self.settings.best_model, self.state
        key = metric_key(rules.metric, metrics)
        value = broadcast_object_list([float(metrics[key])])[0]
        new_best = is_new_best(value, state.best_metric, rules.greater_is_better)
        improved = improves(value, state.best_metric, rules.greater_is_better, rules.threshold)
        state.evaluations_without_improvement = 0 if improved else state.evaluations_without_improvement + 1
        if new_best:
            state.best_metric, state.best_step = value, state.step
        patience_over = rules.patience is not None and state.evaluations_without_improvement >= rules.patience
        if not (patience_over and state.scheduler_steps < self.num_update_steps):
            return new_best, False
        state.stopped_early_at = state.step
        self.accelerator.print(
            f"early stopping: {key} has not improved on {state.best_metric:.4f} (update {state.best_step}) by more "
            f"than {rules.threshold} for {state.evaluations_without_improvement} evaluation(s); stopping after "
            f"update {state.step} of {self.num_update_steps}, with a last checkpoint"
        )
        return new_best, True

    def load_best(self) -> dict[str, Any]:
        """With --load_best_model_at_end, the best evaluation's weights back in the model (from its
        checkpoint, which `save` never deletes); the results' lines on the best evaluation."""
        rules, state = self.settings.best_model, self.state
        if state.best_step is None:
            return {}
        best = {
            "metric_for_best_model": rules.metric,
            "best_metric": state.best_metric,
            "best_step": state.best_step,
            "stopped_early_at": state.stopped_early_at,
        }
        if not rules.load_at_end:
            return best
        if state.best_step != state.step:
            path = Path(self.settings.output_dir) / "checkpoints" / checkpointing.checkpoint_name(state.best_step)
            with collective_timeout.phase("save"):
                self.accelerator.load_state(str(path))
            self.accelerator.print(f"final/ holds the best evaluation's weights: update {state.best_step}, {path}")
        return best | {"final_weights_from_step": state.best_step}

    @contextlib.contextmanager
    def paused(self):
        """Evaluation: left out of the training time and the throughput."""
        with self.clock.paused(), collective_timeout.phase("eval"):
            yield

    def finish(
        self,
        model,
        tokenizer,
        after_save=None,
        final_files: dict[str, str] | None = None,
        **metrics: Any,
    ) -> dict[str, Any]:
        """Save final/ (with `final_files` in it, and whatever `after_save()` saves, returning extra
        results), write all_results.json with `metrics` and the last evaluation's."""
        self.progress.close()
        if self.noise is not None and (advice := self.noise.advice(self.state)):
            self.accelerator.print(advice)
        if self.stop is not None:
            self.stop.restore()
        train_seconds = self.clock.total()
        metrics |= self.load_best()
        with collective_timeout.phase("save"):
            save_final(self.accelerator, model, tokenizer, self.settings.output_dir, extra_files=final_files)
        with collective_timeout.phase("sample"):  # --generate_prompt, --merge_lora: model calls on every rank
            extras = after_save() if after_save else {}
        learning_rate = self.settings.scaled_learning_rate(self.state.effective_batch_size)
        # The last evaluation on record wins over this process's: a run resumed after it has only the record.
        initial = {f"initial_{k}": v for k, v in self.initial_evaluation.items()}
        metrics = {**initial, **self.evaluation, **metrics, **(self.state.eval_metrics or {})}
        collective_timeout.POSITION.phase = "save"
        results = write_results(
            self.accelerator,
            self.state,
            self.train_windows.plan,
            output_dir=self.settings.output_dir,
            learning_rate=learning_rate,
            train_seconds=train_seconds,
            **metrics,
            **extras,
        )
        if self.accelerator.is_main_process:
            write_model_card(self.settings.output_dir)
        # Every process leaves the group together: destroy_process_group is local, and a rank that
        # exits while another still writes can tear gloo down under it.
        self.accelerator.wait_for_everyone()
        end_training(self.accelerator)  # the group destroyed after train()'s locals, not by their release
        if is_exportable_causal_lm(self.accelerator.unwrap_model(model)):
            self.accelerator.print(
                f"deploy it: ft-accum export {self.settings.output_dir} --format gguf (llama.cpp, Ollama; docs in README's Deploy)"
            )
        return results
