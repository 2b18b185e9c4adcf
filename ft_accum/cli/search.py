"""`ft-accum sweep FILE` with a `search:` section: an Optuna study whose trials are real recipe runs.

    recipe: text_classification
    accelerate_config: accelerate_configs/single_gpu_bf16.yaml
    base: {num_train_epochs: 3}
    search:
      n_trials: 12
      metric: eval_accuracy            # a key the recipe logs at each evaluation
      direction: maximize
      sampler: tpe                     # tpe | random | grid | cmaes (Optuna's samplers)
      pruner: {type: median, n_warmup_evaluations: 1}   # median | hyperband | none
      space:
        learning_rate: {low: 1.0e-5, high: 1.0e-3, log: true}
        effective_batch_size: {choices: [16, 32, 64]}
      # storage: postgresql://user:password@host/db   (default: a journal file, <output_dir>/study.journal)
      # enqueue: [{learning_rate: 5.0e-5}]             (trials to run first, e.g. the recipe's default)
      # plan: {model: qwen2.5-0.5b, task: causal_lm, seq_len: 512, gpu_memory: 12GiB}
      # seed: 0                                         (the sampler's; leave it out with several workers)

Optuna samples and prunes; nothing of the search is written here. Each trial is one run of the
recipe through `ft-accum launch` (Accelerate's launch) in `<output_dir>/trial_NNNN/`. The sweep
reads the run's `eval_metrics.jsonl` as it grows and reports each evaluation to the trial (step =
the epoch). When the pruner says stop, the run gets SIGTERM: it finishes its update, leaves a
checkpoint and the command to resume it, and the trial is PRUNED. A crash or a non-finite loss is
FAIL with its error line; an out-of-memory run is run again once at half the micro-batch and the
same effective batch.

`learning_rate` in the space is the recipe's --learning_rate: the base LR, which the recipe scales
from --base_batch_size to each trial's effective batch by its --lr_scaling (with no
--base_batch_size, the LR is used as it is). The trials table shows both. A sampled
`effective_batch_size` gets its micro-batch from the memory planner when the search has a `plan:`
(the GPU's memory and the model), else the largest divisor of it up to the base's micro-batch.

The study is the state: kill the sweep at any moment (even SIGKILL: its run then gets SIGTERM and
stops at a checkpoint) and run the same command again. A trial left RUNNING by a dead sweep is
taken up and resumed from its checkpoint; no trial is lost or run twice, and the study ends at
`n_trials`. `--worker`, started several times on one shared storage (a journal file on a shared
filesystem, or an RDB URL), runs different trials of the same study; new trials are asked for under
a lock file in the output folder, which the workers share.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from ft_accum.core.batch_arithmetic import effective_batch_size, micro_batches_for
from ft_accum.core.errors import ConfigError
from ft_accum.core.lr_scaling import scale_learning_rate
from ft_accum.training.arguments import TrainingArguments, typed_value
from ft_accum.training.model_card import read_record, write_atomically
from ft_accum.training.training_state import RESUME_COMMAND_FILE

SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("median", "hyperband", "none")
SEARCH_KEYS = ("n_trials", "metric", "direction", "sampler", "pruner", "space", "storage", "enqueue", "plan", "seed")
SEARCH_FILE = "search.json"  # what `ft-accum report` needs to find the study
JOURNAL_FILE = "study.journal"
HEARTBEAT_SECONDS = 60
STALE_SECONDS = 600  # a trial whose sweep, on another machine, has not written a heartbeat for this long is taken up
PLAN_KEYS = ("model", "task", "seq_len", "gpu_memory", "precision", "lora_r", "optimizer", "num_processes")


def import_optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            'a search: section needs Optuna, which is not installed; pip install -e ".[search]" (or pip install optuna)'
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def load_search(search: Any, path: Path, recipe: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Check the `search:` section against the recipe's settings; return it with defaults filled in.
    Everything that can be wrong before a trial runs is caught here."""
    where = f"{path}: search"
    if not isinstance(search, dict):
        raise ConfigError(f"{where} must be a mapping (n_trials, metric, direction, space, ...)")
    unknown = sorted(set(search) - set(SEARCH_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(SEARCH_KEYS)}")
    for key in ("n_trials", "metric", "space"):
        if key not in search:
            raise ConfigError(f"{where} needs {key}; e.g. n_trials: 12, metric: eval_accuracy, space: {{...}}")
    n_trials = search["n_trials"]
    if not isinstance(n_trials, int) or isinstance(n_trials, bool) or n_trials < 1:
        raise ConfigError(f"{where}.n_trials must be a whole number ≥ 1, got {n_trials!r}")
    direction = search.get("direction", "maximize")
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"{where}.direction must be maximize or minimize, got {direction!r}")
    sampler = search.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        raise ConfigError(f"{where}.sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    space = search["space"]
    if not isinstance(space, dict) or not space:
        raise ConfigError(f"{where}.space is empty; give each searched setting a range or choices")
    checked = {name: check_dimension(name, spec, settings, recipe, where) for name, spec in space.items()}
    if sampler == "grid":
        ranged = [name for name, d in checked.items() if "choices" not in d]
        if ranged:
            raise ConfigError(
                f"{where}: the grid sampler needs choices for every setting, not a range ({', '.join(ranged)})"
            )
        points = math.prod(len(d["choices"]) for d in checked.values())
        if n_trials > points:
            raise ConfigError(
                f"{where}: the grid has {points} point(s), fewer than n_trials {n_trials}; set n_trials ≤ {points}"
            )
    enqueue = search.get("enqueue") or []
    if not isinstance(enqueue, list) or not all(isinstance(e, dict) for e in enqueue):
        raise ConfigError(f"{where}.enqueue must be a list of mappings of setting: value")
    if len(enqueue) > n_trials:
        raise ConfigError(
            f"{where}.enqueue lists {len(enqueue)} trials, more than n_trials {n_trials}; raise n_trials"
        )
    for entry in enqueue:
        outside = sorted(set(entry) - set(checked))
        if outside:
            raise ConfigError(
                f"{where}.enqueue: {', '.join(outside)} is not in the space; enqueue only searched settings"
            )
        for key, value in entry.items():
            typed_value(value, settings[key], f"{where}.enqueue: {key}")
    plan = search.get("plan")
    if plan is not None:
        if not isinstance(plan, dict) or not {"model", "task", "seq_len"} <= set(plan):
            raise ConfigError(
                f"{where}.plan needs model, task and seq_len (and gpu_memory, default 12GiB), as `ft-accum plan` takes"
            )
        unknown = sorted(set(plan) - set(PLAN_KEYS))
        if unknown:
            raise ConfigError(f"{where}.plan: unknown key(s) {', '.join(unknown)}; valid: {', '.join(PLAN_KEYS)}")
        from ft_accum.planner import configs, memory_planner, task_specs

        if plan["task"] not in task_specs.TASKS:
            raise ConfigError(f"{where}.plan.task must be one of {', '.join(task_specs.TASKS)}, got {plan['task']!r}")
        configs.load_model_config(plan["model"])  # a name it cannot find fails now, naming the shipped ones
        memory_planner.parse_memory(str(plan.get("gpu_memory", "12GiB")))
    return {
        "n_trials": n_trials,
        "metric": str(search["metric"]),
        "direction": direction,
        "sampler": sampler,
        "pruner": check_pruner(search.get("pruner", "median"), where),
        "space": checked,
        "storage": search.get("storage"),
        "enqueue": enqueue,
        "plan": plan,
        "seed": search.get("seed"),
    }


def check_dimension(name: str, spec: Any, settings: dict[str, Any], recipe: Path, where: str) -> dict[str, Any]:
    """One searched setting: {low, high, log?, step?} or {choices: [...]}, of the recipe's type."""
    if name not in settings:
        raise ConfigError(
            f"{where}.space: {name} is not a setting of {recipe.name}, so no flag would take it; "
            f"valid: {', '.join(sorted(settings))}"
        )
    if name in ("output_dir", "resume_from_checkpoint"):
        raise ConfigError(f"{where}.space: the sweep sets {name} itself; search another setting")
    kind = settings[name]
    if isinstance(spec, dict) and "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}.space.{name}: choices is empty; list at least one value")
        for value in choices:
            typed_value(value, kind, f"{where}.space.{name}")
        return {"choices": choices}
    if not isinstance(spec, dict) or not {"low", "high"} <= set(spec):
        raise ConfigError(
            f"{where}.space.{name}: write a range as {{low: ..., high: ..., log: true}} or a list as {{choices: [...]}}"
        )
    low, high = spec["low"], spec["high"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
        raise ConfigError(f"{where}.space.{name}: low and high must be numbers, got {low!r} and {high!r}")
    if not low < high:
        raise ConfigError(f"{where}.space.{name}: the range {low}..{high} is empty or inverted; give low < high")
    log = bool(spec.get("log", False))
    if log and low <= 0:
        raise ConfigError(f"{where}.space.{name}: a log range needs low > 0, got {low}")
    if log and spec.get("step") is not None:
        raise ConfigError(f"{where}.space.{name}: give step or log, not both (Optuna samples one or the other)")
    integer = "int" in str(kind)  # int or Optional[int] (the recipe's annotation)
    if integer and not all(isinstance(v, int) for v in (low, high)):
        raise ConfigError(f"{where}.space.{name} is a whole number; give whole-number low and high")
    if not integer and "float" not in str(kind):
        raise ConfigError(f"{where}.space.{name} is not a number setting; give it {{choices: [...]}}")
    return {"low": low, "high": high, "log": log, "step": spec.get("step"), "integer": integer}


def check_pruner(pruner: Any, where: str) -> dict[str, Any]:
    spec = {"type": pruner} if isinstance(pruner, str) else dict(pruner or {"type": "none"})
    if spec.get("type") not in PRUNERS:
        raise ConfigError(f"{where}.pruner type must be one of {', '.join(PRUNERS)}, got {spec.get('type')!r}")
    allowed = {
        "median": {"n_warmup_evaluations", "n_startup_trials"},
        "hyperband": {"reduction_factor", "max_evaluations"},
    }
    unknown = sorted(set(spec) - {"type"} - allowed.get(spec["type"], set()))
    if unknown:
        raise ConfigError(f"{where}.pruner: {', '.join(unknown)} does not apply to the {spec['type']} pruner")
    return spec


def make_sampler(optuna, search: dict):
    seed = search["seed"]
    if search["sampler"] == "grid":
        return optuna.samplers.GridSampler({k: d["choices"] for k, d in search["space"].items()}, seed=seed)
    if search["sampler"] == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    if search["sampler"] == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(optuna, spec: dict):
    """Steps are evaluations (the epoch index), so trials of different batch sizes compare at equal data."""
    if spec["type"] == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=spec.get("n_startup_trials", 5), n_warmup_steps=spec.get("n_warmup_evaluations", 0)
        )
    if spec["type"] == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=1,
            max_resource=spec.get("max_evaluations", "auto"),
            reduction_factor=spec.get("reduction_factor", 3),
        )
    return optuna.pruners.NopPruner()


def open_storage(optuna, search: dict, output_dir: Path, worker: bool):
    """The journal file in the output folder by default, else the RDB URL; refused where it cannot be opened,
    and under --worker where it cannot be shared."""
    url = search["storage"]
    if url is None or str(url).startswith("journal:"):
        path = Path(str(url).removeprefix("journal:")) if url else output_dir / JOURNAL_FILE
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            backend = JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path)))
        except OSError as exc:
            raise ConfigError(f"cannot open the study's journal file {path}: {exc.strerror}; check the path") from None
        return optuna.storages.JournalStorage(backend), f"journal:{path}"
    url = str(url)
    if worker and (url.startswith("sqlite") or ":memory:" in url):
        raise ConfigError(
            f"--worker needs a storage several sweeps can write at once; {url} is a SQLite file, whose locks Optuna "
            "advises against for parallel workers (and which fail on network filesystems). Leave storage out (a "
            "journal file in the output folder, on a filesystem every worker sees) or give postgresql:// or mysql://"
        )
    try:
        return optuna.storages.RDBStorage(url, skip_compatibility_check=False), url
    except Exception as exc:  # SQLAlchemy's errors: a bad URL, a missing driver, a server that does not answer
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"cannot open the study storage {url}: {reason}; check the URL (e.g. sqlite:///study.db, "
            "postgresql://user:password@host/db) and that its driver is installed, or leave storage out for a journal file"
        ) from None


class AskLock:
    """The output folder's lock file (Optuna's NFS-safe O_EXCL lock): one sweep at a time counts the
    trials, takes up an abandoned one or asks for a new one, so the study never passes n_trials."""

    def __init__(self, output_dir: Path):
        from optuna.storages.journal import JournalFileOpenLock

        self.lock = JournalFileOpenLock(str(output_dir / ".trials"), grace_period=30)

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()


def this_process() -> str:
    """`host:pid:start-time`: a process id that a later process with the same pid does not match."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def _start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def owner_is_gone(owner: str | None, heartbeat: float | None, now: float) -> bool:
    """Whether the sweep that ran a RUNNING trial has died: on this machine, its process is gone; on
    another, it has not written a heartbeat for STALE_SECONDS."""
    if not owner:
        return True
    host, pid, started = owner.rsplit(":", 2)
    if host == socket.gethostname():
        return _start_time(int(pid)) != started
    return heartbeat is None or now - heartbeat > STALE_SECONDS


def claim_trial(optuna, study, search: dict):
    """(trial, taken_up) for this sweep to run, or None when the study has n_trials and none is abandoned."""
    trials = study.get_trials(deepcopy=False)
    now = time.time()
    for frozen in trials:
        attrs = frozen.user_attrs
        if frozen.state == optuna.trial.TrialState.RUNNING and owner_is_gone(
            attrs.get("owner"), attrs.get("heartbeat"), now
        ):
            trial = optuna.trial.Trial(study, frozen._trial_id)
            trial.set_user_attr("owner", this_process())
            trial.set_user_attr("heartbeat", now)
            return trial, True
    waiting = any(t.state == optuna.trial.TrialState.WAITING for t in trials)  # enqueued: ask() pops these first
    if len(trials) >= search["n_trials"] and not waiting:
        return None
    trial = study.ask()
    trial.set_user_attr("owner", this_process())
    trial.set_user_attr("heartbeat", now)
    sample(trial, search["space"])  # under the lock: the next ask sees these parameters
    return trial, False


def sample(trial, space: dict) -> dict[str, Any]:
    """The trial's values; asked again for a trial taken up, Optuna returns the stored ones."""
    values = {}
    for name, d in space.items():
        if "choices" in d:
            values[name] = trial.suggest_categorical(name, d["choices"])
        elif d["integer"]:
            values[name] = trial.suggest_int(name, d["low"], d["high"], step=d["step"] or 1, log=d["log"])
        else:
            values[name] = trial.suggest_float(name, d["low"], d["high"], step=d["step"], log=d["log"])
    return values


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


def run_search(sweep: dict, worker: bool = False, dry_run: bool = False) -> dict:
    """Run (or go on with) the study until it has n_trials finished; return {"runs": {trial: record}}."""
    from ft_accum.cli import launching
    from ft_accum.training.run_outputs import lock_output_dir

    optuna = import_optuna()
    search, output_dir = sweep["search"], Path(sweep["output_dir"])
    study_name = Path(sweep["path"]).stem
    if dry_run:  # writes nothing
        where = search["storage"] or f"journal:{output_dir / JOURNAL_FILE}"
        print(f"search of {Path(sweep['recipe']).name}: {search['n_trials']} trials, {search['sampler']} sampler, "
              f"{search['pruner']['type']} pruner, {search['direction']} {search['metric']}; study {study_name} in {where}")  # fmt: skip
        for name, d in search["space"].items():
            shown = d["choices"] if "choices" in d else f"{d['low']} to {d['high']}" + (", log" if d["log"] else "")
            print(f"  {name}: {shown}")
        return {"runs": {}}
    output_dir.mkdir(parents=True, exist_ok=True)
    storage, storage_url = open_storage(optuna, search, output_dir, worker)
    if not worker:  # one sweep per folder, unless the workers share it on purpose
        lock_output_dir(output_dir)
    with AskLock(output_dir):
        study = optuna.create_study(
            study_name=study_name,
            storage=storage,
            sampler=make_sampler(optuna, search),
            pruner=make_pruner(optuna, search["pruner"]),
            direction=search["direction"],
            load_if_exists=True,
        )
        if not study.get_trials(deepcopy=False):
            for params in search["enqueue"]:
                study.enqueue_trial(params)
    default_micro = launching.default_micro(Path(sweep["recipe"]))
    num_processes = _num_processes(sweep["accelerate_config"])
    write_atomically(output_dir / SEARCH_FILE, json.dumps({
        "study_name": study_name, "storage": storage_url, "metric": search["metric"],
        "direction": search["direction"], "recipe": sweep["recipe"], "n_trials": search["n_trials"],
        "space": search["space"], "num_processes": num_processes,
    }, indent=2) + "\n")  # fmt: skip
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        while True:
            with AskLock(output_dir):
                claimed = claim_trial(optuna, study, search)
            if claimed is None:
                break
            trial, taken_up = claimed
            run_trial(optuna, sweep, study, trial, taken_up, default_micro, num_processes)
    finally:
        signal.signal(signal.SIGTERM, previous)
    records = trial_records(optuna, study, output_dir, num_processes)
    write_search_results(output_dir, records, search)
    counts = {s: sum(r["state"] == s for r in records) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
    best = best_record(records, search["direction"])
    print(
        f"search done: {counts['COMPLETE']} complete, {counts['PRUNED']} pruned, {counts['FAIL']} failed"
        + (f", {counts['RUNNING']} still running in other workers" if counts["RUNNING"] else "")
        + (f"; best {search['metric']} {best['value']:.4g} ({best['run']})" if best else "")
        + f"; results in {output_dir / 'results.md'}",
        flush=True,
    )
    status = {"COMPLETE": "ok", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running", "WAITING": "pending"}
    return {"runs": {r["run"]: {"status": status[r["state"]]} for r in records}}


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # through launch_and_watch: the run stops at a checkpoint first


def _num_processes(accelerate_config: str | None) -> int:
    from ft_accum.training.arguments import read_yaml

    config = read_yaml(Path(accelerate_config)) if accelerate_config else {}
    return int((config or {}).get("num_processes", 1) or 1)


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


def load_search_study(output_dir: Path):
    """(optuna, study, search.json's record) of a search's output folder, for `ft-accum report`."""
    optuna = import_optuna()
    record = json.loads((output_dir / SEARCH_FILE).read_text())
    storage, _ = open_storage(optuna, {"storage": record["storage"]}, output_dir, worker=False)
    return optuna, optuna.load_study(study_name=record["study_name"], storage=storage), record


def trial_records(optuna, study, output_dir: Path, num_processes: int) -> list[dict[str, Any]]:
    """One row per trial: parameters, base and final LR, metric, state, updates done, wall time."""
    rows = []
    for frozen in study.get_trials(deepcopy=False):
        attrs = frozen.user_attrs
        run = attrs.get("run", f"trial_{frozen.number:04d}")
        args = attrs.get("args") or {}
        metrics = output_dir / run / "metrics.jsonl"
        rows.append({
            "run": run,
            "number": frozen.number,
            "state": frozen.state.name,
            "value": frozen.value,
            "params": dict(frozen.params),
            "final_learning_rate": final_learning_rate(args, num_processes) if args else None,
            "per_device_train_batch_size": args.get("per_device_train_batch_size"),
            "evaluations": len(frozen.intermediate_values),
            "last_reported": frozen.intermediate_values[max(frozen.intermediate_values)] if frozen.intermediate_values else None,
            "updates": len(metrics.read_text().splitlines()) if metrics.exists() else 0,
            "wall_seconds": round(attrs.get("wall_seconds", 0.0), 1),
            "command": attrs.get("command", ""),
            "resume_command": attrs.get("resume_command"),
            "error": attrs.get("error", ""),
            "same_as": attrs.get("same_as"),
        })  # fmt: skip
    return rows


def best_record(records: list[dict], direction: str) -> dict | None:
    complete = [r for r in records if r["state"] == "COMPLETE" and r["value"] is not None]
    if not complete:
        return None
    return (max if direction == "maximize" else min)(complete, key=lambda r: r["value"])


def trials_table(records: list[dict], search: dict) -> list[str]:
    """The markdown table of the trials, in order."""
    names = list(dict.fromkeys(k for r in records for k in r["params"]))
    columns = ["trial", *names]
    if "learning_rate" in names:
        columns.append("final LR")
    columns += [search["metric"], "state", "evaluations", "updates", "wall s"]

    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in records:
        values = [r["run"], *(r["params"].get(n) for n in names)]
        if "learning_rate" in names:
            values.append(r["final_learning_rate"])
        metric = r["value"] if r["state"] == "COMPLETE" else r["last_reported"]
        state = r["state"].lower() + (f" ({r['error']})" if r["error"] else "")
        state += f" (as {r['same_as']}, not run again)" if r.get("same_as") else ""
        values += [metric, state.replace("|", "\\|"), r["evaluations"], r["updates"], r["wall_seconds"]]
        lines.append("| " + " | ".join(cell(v) for v in values) + " |")
    return lines


def summary_lines(records: list[dict], search: dict) -> list[str]:
    """The trials table and the best trial's command, as markdown lines: results.md, and the head of
    `ft-accum report` on a search folder. `search` needs metric, direction and n_trials."""
    best = best_record(records, search["direction"])
    text = [f"# Search: {search['direction']} {search['metric']}, {len(records)} of {search['n_trials']} trials", ""]
    text += trials_table(records, search)
    text.append("")
    text.append(
        "`final LR` is the LR the run trained at: the searched --learning_rate scaled by the recipe's "
        "--lr_scaling to the trial's effective batch. A pruned trial's metric is its last reported evaluation."
    )
    if best:
        text += ["", f"Best: {best['run']}, {search['metric']} {best['value']:.4g}. Reproduce it with:", "",
                 "```bash", best["command"], "```"]  # fmt: skip
    return text


def write_search_results(output_dir: Path, records: list[dict], search: dict) -> None:
    """results.md (`summary_lines`) and results.json."""
    best = best_record(records, search["direction"])
    write_atomically(output_dir / "results.json", json.dumps({"trials": records, "best": best}, indent=2) + "\n")
    write_atomically(output_dir / "results.md", "\n".join(summary_lines(records, search)) + "\n")
