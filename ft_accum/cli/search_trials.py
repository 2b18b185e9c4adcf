"""One trial of a search: a real run of the recipe with the sampled settings (its batch split from the planner
or the base), its evaluations reported to Optuna as they are logged, pruned with SIGTERM, and the
command that reproduces it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

from ft_accum.cli.search_space import sample
from ft_accum.cli.search_study import HEARTBEAT_SECONDS
from ft_accum.core.batch_arithmetic import effective_batch_size, micro_batches_for
from ft_accum.core.errors import ConfigError
from ft_accum.core.lr_scaling import scale_learning_rate
from ft_accum.training.arguments import TrainingArguments
from ft_accum.training.model_card import read_record
from ft_accum.training.training_state import RESUME_COMMAND_FILE


def batch_settings(args: dict[str, Any], plan: dict | None, default_micro: int, num_processes: int) -> dict[str, Any]:
    """A sampled effective batch split as micro × accumulation × processes: the planner's recommendation
    for the search's GPU (`plan:`), else the largest micro-batch that divides it, up to the base's."""
    if "effective_batch_size" not in args:
        return args
    effective = int(args["effective_batch_size"])
    args = {k: v for k, v in args.items() if k != "gradient_accumulation_steps"}  # derived from the effective batch
    if plan:
        from ft_accum.planner import memory_planner

        settings = {k: v for k, v in plan.items() if k not in ("model", "gpu_memory")}
        result = memory_planner.plan(
            plan["model"],
            effective_batch_size=effective,
            gpu_memory_gib=memory_planner.parse_memory(str(plan.get("gpu_memory", "12GiB"))),
            **settings,
        )
        best = result["recommended"]
        if best is None:
            raise ConfigError(f"no split of the effective batch {effective} fits {plan.get('gpu_memory', '12GiB')}")
        args["per_device_train_batch_size"] = best["per_device_train_batch_size"]
        if best["gradient_checkpointing"]:
            args["gradient_checkpointing"] = True
        return args
    cap = int(args.get("per_device_train_batch_size", default_micro))
    args["per_device_train_batch_size"] = max(m for m in micro_batches_for(effective, num_processes) if m <= cap)
    return args


def final_learning_rate(args: dict[str, Any], num_processes: int) -> float | None:
    """The LR the recipe trains at: --learning_rate scaled from --base_batch_size to the effective batch."""
    defaults = TrainingArguments.__dataclass_fields__

    def value(name):
        return args.get(name, defaults[name].default)

    effective = value("effective_batch_size") or effective_batch_size(
        int(value("per_device_train_batch_size")), int(value("gradient_accumulation_steps") or 1), num_processes
    )
    base = value("base_batch_size")
    return scale_learning_rate(
        float(value("learning_rate")), int(effective), int(base) if base else None, value("lr_scaling"), value("optim")
    )


def read_evaluations(run_dir: Path) -> list[dict[str, Any]]:
    """eval_metrics.jsonl's records; a line the recipe is still writing is left for the next read."""
    from ft_accum.training.run_outputs import EVAL_METRICS_FILE

    path = run_dir / EVAL_METRICS_FILE
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records


def wait_for_run_to_stop(run_dir: Path, timeout: float = 900) -> None:
    """A run whose sweep was killed stops on its own at a checkpoint (PR_SET_PDEATHSIG, see
    launching.launch_and_watch); wait until it has let go of its folder before resuming it there."""
    import fcntl

    from ft_accum.training.run_outputs import LOCK_FILE

    if not (run_dir / LOCK_FILE).exists():
        return
    fd, deadline = os.open(run_dir / LOCK_FILE, os.O_RDWR), time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConfigError(
                        f"{run_dir} is still held by a run after {timeout:.0f} s; stop it, then run again"
                    ) from None
                time.sleep(0.5)
    finally:
        os.close(fd)


class MetricNotLogged(ConfigError):
    pass


class EvaluationReporter:
    """Called about twice a second while a trial's run goes: a heartbeat now and then, each new
    evaluation reported to the trial, and the graceful stop (SIGTERM) when the pruner says so."""

    def __init__(self, trial, run_dir: Path, search: dict, recipe_name: str, reported: set[int]):
        self.trial, self.run_dir, self.search, self.recipe_name = trial, run_dir, search, recipe_name
        self.reported, self.pruned, self.last_beat = reported, False, time.monotonic()

    def __call__(self, process, began) -> None:
        trial, metric = self.trial, self.search["metric"]
        if time.monotonic() - self.last_beat > HEARTBEAT_SECONDS:
            trial.set_user_attr("heartbeat", time.time())
            self.last_beat = time.monotonic()
        if self.pruned:
            return
        for record in read_evaluations(self.run_dir):
            step = int(record["epoch"])  # evaluations come once per epoch, the same data for every trial
            if step in self.reported:
                continue
            if metric not in record:
                logged = sorted(k for k in record if k not in ("epoch", "step"))
                raise MetricNotLogged(
                    f"{self.recipe_name} does not log {metric} at its evaluations; it logs {', '.join(logged)}. "
                    "Set search.metric to one of them"
                )
            trial.report(float(record[metric]), step)
            self.reported.add(step)
            if trial.should_prune():
                print(f"  {self.run_dir.name}: pruned at evaluation {step} ({metric} {record[metric]:.4g}); "
                      "stopping it at a checkpoint", flush=True)  # fmt: skip
                self.pruned = True
                os.killpg(process.pid, signal.SIGTERM)  # the graceful stop: a checkpoint, then exit 143
                return


def tell_repeat(optuna, study, trial, params: dict, name: str, search: dict) -> bool:
    """A trial whose parameters a finished trial already ran gets that trial's evaluations and end
    without a run: the runs are seeded, so the same settings end the same (bit-identical on CPU:
    tests/test_fault_injection.py and test_sweep.py compare separate runs of one seed at 0.0).
    Samplers repeat themselves over `choices` (TPE's first trials are random); Optuna's FAQ ("How can
    I ignore duplicated samples?") answers them the same way."""
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    earlier = next(
        (
            t
            for t in study.get_trials(deepcopy=False, states=states)
            if t.params == params and t.number != trial.number
        ),
        None,
    )
    if earlier is None:
        return False
    for step, value in sorted(earlier.intermediate_values.items()):
        trial.report(value, step)
    source = earlier.user_attrs.get("same_as") or earlier.user_attrs.get("run", f"trial_{earlier.number:04d}")
    for key in ("args", "command"):
        if key in earlier.user_attrs:
            trial.set_user_attr(key, earlier.user_attrs[key])
    trial.set_user_attr("run", name)
    trial.set_user_attr("same_as", source)
    state = earlier.state.name.lower()
    print(f"[trial {trial.number + 1}/{search['n_trials']}] {name}: the settings of {source}, which ended {state}; "
          "told the same without a run", flush=True)  # fmt: skip
    if earlier.state == optuna.trial.TrialState.COMPLETE:
        study.tell(trial, earlier.value)
    else:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    return True


def run_trial(optuna, sweep: dict, study, trial, taken_up: bool, default_micro: int, num_processes: int) -> None:
    """One trial: the run (resumed if it has a checkpoint), its evaluations reported, then told its state."""
    from ft_accum.cli import launching

    search, output_dir = sweep["search"], Path(sweep["output_dir"])
    name = f"trial_{trial.number:04d}"
    run_dir = output_dir / name
    params = sample(trial, search["space"])
    if not taken_up and tell_repeat(optuna, study, trial, params, name, search):
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    attrs = dict(frozen.user_attrs)
    try:
        args = attrs.get("replanned_args") or batch_settings(
            {**sweep["base"], **params}, search["plan"], default_micro, num_processes
        )
    except ConfigError as exc:
        trial.set_user_attr("error", f"error: {exc}")
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        print(f"  {name}: failed: {exc}", flush=True)
        return
    reported = set(frozen.intermediate_values)
    if taken_up and read_record(run_dir, "all_results.json"):
        # Its run finished before the study recorded it (the worker was killed in between): record it from
        # its results. Launched again, the recipe would refuse the folder, and the trial would be lost.
        print(f"[trial {trial.number + 1}/{search['n_trials']}] {name}: taken up, its run had finished", flush=True)
        tell_finished(optuna, study, trial, run_dir, search, name)
        return
    print(f"[trial {trial.number + 1}/{search['n_trials']}] {name}"
          + (" (taken up, resuming)" if taken_up else "") + ": "
          + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items()), flush=True)  # fmt: skip
    while True:
        wait_for_run_to_stop(run_dir)
        command = launching.command_for(sweep, {"args": args}, run_dir)
        trial.set_user_attr("run", name)
        trial.set_user_attr("args", json.loads(json.dumps(args)))
        trial.set_user_attr("command", reproduce_command(sweep, args))
        watch = EvaluationReporter(trial, run_dir, search, Path(sweep["recipe"]).name, reported)

        try:
            returncode, wall, timed_out = launching.launch_and_watch(command, run_dir, sweep["timeout_per_run"], watch)
        except MetricNotLogged as exc:
            trial.set_user_attr("error", f"error: {exc}")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            raise
        attrs["wall_seconds"] = attrs.get("wall_seconds", 0.0) + wall  # every attempt's, a resumed one's too
        trial.set_user_attr("wall_seconds", attrs["wall_seconds"])
        results = read_record(run_dir, "all_results.json")
        if watch.pruned:
            trial.set_user_attr("resume_command", _read_text(run_dir / RESUME_COMMAND_FILE))
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            return
        if returncode == 0 and results:
            tell_finished(optuna, study, trial, run_dir, search, name)
            return
        tail = (run_dir / "log.txt").read_text(errors="replace")[-4000:]
        if any(m in tail for m in launching.OOM_MARKERS) and not attrs.get("replanned_args"):
            args = launching.replan_for_memory(args, default_micro)
            attrs["replanned_args"] = args
            trial.set_user_attr("replanned_args", json.loads(json.dumps(args)))
            print(f"  {name}: out of memory; again with per_device_train_batch_size "
                  f"{args['per_device_train_batch_size']} (same effective batch)", flush=True)  # fmt: skip
            continue
        error = (
            f"timed out after {sweep['timeout_per_run']:.0f} s"
            if timed_out
            else launching.error_line(run_dir / "log.txt")
        )
        trial.set_user_attr("error", error)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        print(f"  {name}: failed: {error}", flush=True)
        return


def tell_finished(optuna, study, trial, run_dir: Path, search: dict, name: str) -> None:
    """Tell the study a finished run's metric: all_results.json's, else its last logged evaluation's."""
    results = read_record(run_dir, "all_results.json") or {}
    value = results.get(search["metric"])
    if value is None or not math.isfinite(value):
        values = [r[search["metric"]] for r in read_evaluations(run_dir) if search["metric"] in r]
        value = values[-1] if values else None
    if value is None:
        trial.set_user_attr("error", f"the run ended without logging {search['metric']}")
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return
    study.tell(trial, float(value))
    print(f"  {name}: {search['metric']} {value:.4g}", flush=True)


def reproduce_command(sweep: dict, args: dict[str, Any]) -> str:
    """The trial as one `accelerate launch` a user can paste, into a new output folder."""
    import shlex

    launch = ["accelerate", "launch"] + (
        ["--config_file", _relative(sweep["accelerate_config"])] if sweep["accelerate_config"] else []
    )
    flags = [f"--{k}={v}" for k, v in args.items()]
    output_dir = Path(sweep["output_dir"]) / "best"
    return shlex.join([*launch, _relative(sweep["recipe"]), "--config=none", *flags, f"--output_dir={output_dir}"])


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
