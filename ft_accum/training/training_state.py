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

import torch
from accelerate.utils import find_batch_size

from ft_accum.core.batch_arithmetic import BatchPlan
from ft_accum.core.errors import register_progress_bar
from ft_accum.core.loss_normalization import WindowTotals, check_skipped_updates
from ft_accum.training import checkpointing, collective_timeout
from ft_accum.training.model_card import is_exportable_causal_lm, write_model_card
from ft_accum.training.run_outputs import log_update, save_final, truncate_metrics, write_results


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
    train_seconds: float = 0.0
    skipped_updates: int = 0  # fp16 overflow
    consecutive_skipped: int = 0
    noise_scale_ema: Optional[dict] = None
    last_checkpoint: Optional[str] = None

    def complete_update(
        self,
        totals: WindowTotals,
        plan: BatchPlan,
        skipped: bool,
        scheduler_steps: int,
        max_consecutive_skipped_updates: int,
    ) -> None:
        """Count one optimizer update; stop the run when fp16 has skipped too many in a row."""
        self.step += 1
        self.scheduler_steps += scheduler_steps
        self.epoch_samples += plan.micro * totals.micro_batches
        self.samples_seen += int(totals.samples)
        self.tokens_seen += int(totals.tokens)
        self.skipped_updates += skipped
        self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0
        check_skipped_updates(
            self.consecutive_skipped, max_consecutive_skipped_updates, self.step, self.last_checkpoint
        )

    def record(
        self,
        totals: WindowTotals,
        plan: BatchPlan,
        learning_rate: float,
        seconds: float,
        batches_per_epoch: int,
        **extra: Any,
    ) -> dict[str, Any]:
        """The metrics.jsonl line of the update just completed."""
        return {
            "step": self.step,
            "epoch": self.epoch + self.epoch_samples / (plan.micro * batches_per_epoch),
            "loss": totals.loss,
            "lr": learning_rate,
            "grad_norm": totals.grad_norm,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "samples_per_second": totals.samples / seconds,
            "tokens_per_second": totals.tokens / seconds,
            "skipped_updates": self.skipped_updates,
            "per_device_train_batch_size": plan.micro,
            "gradient_accumulation_steps": plan.accumulation,
            "effective_batch_size": self.effective_batch_size,
            **extra,
        }

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


def real_rows(dataset_rows: int, batch_index: int, num_processes: int, process_index: int, micro: int) -> int:
    """How many leading rows of this process's micro-batch `batch_index` (0-based in the epoch) are
    real rows of the dataset, not Accelerate's repeats: clamp(n − (k·P + r)·b, 0, b).

    Accelerate's sharded sampler (`BatchSamplerShard` with `even_batches=True`, its default) deals
    the epoch's batches of b rows round-robin: batch k of process r is batch k·P + r of one stream,
    and it completes the last short batch, and any missing round, with rows from the epoch's
    start, so that every process runs as many micro-batches (DDP needs every process in each
    all-reduce). Those repeats sit at the end of the stream, at positions ≥ n.
    """
    return max(0, min(micro, dataset_rows - (batch_index * num_processes + process_index) * micro))


def take_rows(batch: dict, count: int) -> dict:
    """The first `count` rows of every tensor in `batch` that has one row per sample (all of them if it has fewer)."""
    rows = find_batch_size(batch)
    if count >= rows:
        return batch
    return {
        k: v[:count] if isinstance(v, torch.Tensor) and v.dim() and len(v) == rows else v for k, v in batch.items()
    }


def remaining_batches(accelerator, train_dataloader, state: TrainingState, plan: BatchPlan):
    """This epoch's micro-batches from where the run stands, as (batch, is_padding) pairs.

    Checkpoints are taken at sync steps, so the epoch has consumed whole windows; the seeded
    sampler gives the same order whatever the split (see data_sources.seeded_dataloaders).

    When the rows do not divide evenly over the processes, Accelerate repeats rows to even out
    the last batches (see `real_rows`). Those repeats are cut from a micro-batch that holds real
    rows; a micro-batch that holds none is yielded whole with `is_padding=True`, for the recipe to
    run (every process must join the gradient all-reduce) and count as nothing. So the window
    sums only real rows and tokens on every process, and equals the single-process window.
    """
    train_dataloader.set_epoch(state.epoch)
    seen = state.epoch_samples // plan.micro
    batches = accelerator.skip_first_batches(train_dataloader, seen) if seen else train_dataloader
    dataset_rows = len(train_dataloader.dataset)
    for index, batch in enumerate(batches, start=seen):
        real = real_rows(dataset_rows, index, accelerator.num_processes, accelerator.process_index, plan.micro)
        yield (batch, True) if real == 0 else (take_rows(batch, real), False)


def remaining_batches_with_window_totals(accelerator, train_dataloader, state: TrainingState, plan: BatchPlan, count):
    """`remaining_batches`, each as (batch, is_padding, window_totals): `window_totals` is the sum of
    `count(batch)` (a 1-D tensor) over the window's real micro-batches on all processes, known
    before the window's first forward.

    For a loss with two normalisers (ORPO: a mean over pairs plus a mean over chosen tokens), one
    rescale at the sync step cannot be exact; each micro-batch must weigh its terms by the window's
    totals. So the window's micro-batches are fetched first (token ids only, in host memory) and
    their counts all-reduced once. Accelerate's prepared loader marks its last batch when it is
    fetched (`end_of_dataloader`, which `accumulate()` reads to sync a short last window), so that
    public flag is replayed as it was at each fetch. The window is `plan.accumulation` micro-batches
    (the last one shorter): an accumulation schedule, which sizes a window at its start, does not mix.
    """
    stream = remaining_batches(accelerator, train_dataloader, state, plan)
    left = len(train_dataloader) - state.epoch_samples // plan.micro
    while left > 0:
        window = []
        for _ in range(min(plan.accumulation, left)):  # never past the last batch: that would end the loader
            batch, is_padding = next(stream)
            window.append((batch, is_padding, accelerator.gradient_state.end_of_dataloader))
        left -= len(window)
        totals = sum(count(batch) * (not is_padding) for batch, is_padding, _ in window)
        totals = accelerator.reduce(totals.to(accelerator.device, torch.float64), reduction="sum")
        loader = accelerator.gradient_state.active_dataloader
        for batch, is_padding, at_end in window:
            loader.end_of_dataloader = at_end
            yield batch, is_padding, totals
    for _ in stream:  # exhaust it, so that the loader ends its epoch
        raise RuntimeError("remaining_batches_with_window_totals: more batches than the loader's length")


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
    path = checkpointing.save_checkpoint(
        accelerator, output_dir, state.step, state.to_checkpoint(signature), save_total_limit
    )
    state.last_checkpoint = str(path)
    return path


RESUME_COMMAND_FILE = "resume_command.txt"


@dataclass(frozen=True)
class RunSettings:
    """What a run's bookkeeping needs of its arguments (run_setup.run_settings builds it)."""

    output_dir: str
    checkpointing_steps: Optional[int]
    save_total_limit: Optional[int]
    max_consecutive_skipped_updates: int
    scaled_learning_rate: Callable[[int], float]  # the peak LR for an effective batch (--lr_scaling)


class RunTracker:
    """What happens once per update besides the update itself: the counters, metrics.jsonl and the
    tracker, the progress bar, checkpoints, and the graceful stop; and the end of the run.

    `end_update` is the recipe's one call at each sync step, after `optimizer.step()`; it returns
    True when the run has made its last update. `stop` is a `GracefulStop` (or None to do without);
    its resume command goes to `RESUME_COMMAND_FILE` in the output folder.
    """

    def __init__(
        self,
        accelerator,
        settings: RunSettings,
        state: TrainingState,
        signature: dict[str, Any],
        num_update_steps: int,
        stop=None,
    ):
        from tqdm.auto import tqdm

        self.accelerator, self.settings, self.state, self.signature = accelerator, settings, state, signature
        self.stop = stop
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

    def end_update(
        self,
        totals: WindowTotals,
        plan: BatchPlan,
        lr_scheduler,
        *,
        batches_per_epoch: int,
        lr_steps: int = 1,
        **columns: Any,
    ) -> bool:
        """Count the update, log its record (`columns` are extra metrics.jsonl columns), checkpoint when due
        or when a signal asks to stop (which then ends the process). True after the last update.

        `batches_per_epoch` (this epoch's micro-batches per process) gives the record's fractional epoch;
        `lr_steps` is how many LR-scheduler steps the update took (more than 1 when an adaptive
        accumulation schedule catches the LR up, `AccumulationScheduler.catch_up_lr`)."""
        state, settings = self.state, self.settings
        skipped = self.accelerator.optimizer_step_was_skipped
        state.complete_update(totals, plan, skipped, lr_steps, settings.max_consecutive_skipped_updates)
        collective_timeout.POSITION.updates_done = state.step
        record = state.record(
            totals, plan, float(lr_scheduler.get_last_lr()[0]), self.clock.lap(), batches_per_epoch, **columns
        )
        log_update(self.accelerator, settings.output_dir, record, self.progress, lr_steps)
        stopping = self.stop is not None and self.stop.requested(self.accelerator)
        if stopping or (settings.checkpointing_steps and state.step % settings.checkpointing_steps == 0):
            with self.clock.paused(), collective_timeout.phase("save"):
                path = save_checkpoint(
                    self.accelerator,
                    settings.output_dir,
                    state,
                    self.signature,
                    settings.save_total_limit,
                    self.clock.total(),
                )
            collective_timeout.POSITION.last_checkpoint = str(path)
            if stopping:
                self.stop.exit(self.accelerator, path)
        return state.scheduler_steps >= self.num_update_steps

    @contextlib.contextmanager
    def paused(self):
        """Evaluation: left out of the training time and the throughput."""
        with self.clock.paused(), collective_timeout.phase("eval"):
            yield

    def finish(self, model, tokenizer, plan: BatchPlan, after_save=None, **metrics: Any) -> dict[str, Any]:
        """Save final/ (and whatever `after_save()` saves, returning extra results), write all_results.json."""
        self.progress.close()
        if self.stop is not None:
            self.stop.restore()
        train_seconds = self.clock.total()
        with collective_timeout.phase("save"):
            save_final(self.accelerator, model, tokenizer, self.settings.output_dir)
        with collective_timeout.phase("sample"):  # --generate_prompt, --merge_lora: model calls on every rank
            extras = after_save() if after_save else {}
        learning_rate = self.settings.scaled_learning_rate(self.state.effective_batch_size)
        collective_timeout.POSITION.phase = "save"
        results = write_results(
            self.accelerator,
            self.state,
            plan,
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
        self.accelerator.end_training()
        if is_exportable_causal_lm(self.accelerator.unwrap_model(model)):
            self.accelerator.print(
                f"deploy it: ft-accum export {self.settings.output_dir} --format gguf (llama.cpp, Ollama; docs in README's Deploy)"
            )
        return results
