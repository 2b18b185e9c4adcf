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
import signal
from pathlib import Path

from ft_accum.cli.search_results import SEARCH_FILE, best_record, trial_records, write_search_results
from ft_accum.cli.search_space import import_optuna, make_pruner, make_sampler
from ft_accum.cli.search_study import JOURNAL_FILE, AskLock, claim_trial, open_storage
from ft_accum.cli.search_trials import run_trial
from ft_accum.training.model_card import write_atomically


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
    from ft_accum.training.yaml_config import read_yaml

    config = read_yaml(Path(accelerate_config)) if accelerate_config else {}
    return int((config or {}).get("num_processes", 1) or 1)
