"""`ft-accum sweep` with a `search:` section: an Optuna study of real `accelerate launch` runs, on CPU."""

import json
import os
import shlex
import subprocess
import sys
import time

import pytest
import yaml
from conftest import CPU_CONFIG, FAULT_HOOKS, ROOT, read_metrics, run_in_process

from ft_accum.cli import search_results, search_space, search_study, search_trials
from ft_accum.cli import sweep as sweep_module
from ft_accum.cli.main import build_parser
from ft_accum.cli.main import main as cli_main

optuna = pytest.importorskip("optuna")

TINY = {
    "max_seq_length": 48,
    "lr_scaling": "none",
    "num_warmup_steps": 0,
    "weight_decay": 0.0,
    "num_train_epochs": 3,
    "report_to": "none",
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
}


def write_search(tmp_path, tiny_model_dir, data_files, base=None, **search):
    path = tmp_path / "search.yaml"
    spec = {
        "recipe": "text_classification",
        "accelerate_config": str(CPU_CONFIG),
        "output_dir": str(tmp_path / "search_out"),
        "base": {
            **TINY,
            "model_name_or_path": str(tiny_model_dir),
            "train_file": str(data_files["train"]),
            "validation_file": str(data_files["validation"]),
            **(base or {}),
        },
        "search": {
            "n_trials": 4,
            "metric": "eval_loss",
            "direction": "minimize",
            "sampler": "random",
            "seed": 0,
            "pruner": {"type": "median", "n_startup_trials": 1, "n_warmup_evaluations": 0},
            "space": {"learning_rate": {"low": 1.0e-5, "high": 3.0e-3, "log": True}},
            **search,
        },
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def sweep_command(path, *extra):
    return [sys.executable, "-m", "ft_accum.cli.main", "sweep", str(path), *extra]


def load_study(tmp_path):
    record = json.loads((tmp_path / "search_out" / search_results.SEARCH_FILE).read_text())
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(record["storage"].removeprefix("journal:"))
    )
    return optuna.load_study(study_name=record["study_name"], storage=storage)


def launches(run_dir):
    """How many times the sweep started the run: one `$ ...` line each in its log."""
    return sum(line.startswith("$ ") for line in (run_dir / "log.txt").read_text().splitlines())


@pytest.mark.launch
def test_a_search_prunes_a_bad_trial_at_a_checkpoint_that_resumes(tmp_path, tiny_model_dir, data_files):
    """4 trials, enqueued. The first has a good LR, the second one 300× smaller: the median pruner
    stops it at its first evaluation, worse than the first's; the run gets the graceful stop, leaves a
    checkpoint and its resume command, and the trial is PRUNED. The third names a model that does not
    exist: FAIL, with the recipe's error line. The fourth repeats the first: told its end, not run."""
    models = [str(tiny_model_dir), str(tmp_path / "no-such-model")]
    path = write_search(
        tmp_path, tiny_model_dir, data_files, base={"num_train_epochs": 2},
        space={"learning_rate": {"low": 1.0e-5, "high": 3.0e-3, "log": True}, "model_name_or_path": {"choices": models}},
        enqueue=[{"learning_rate": 3e-3, "model_name_or_path": models[0]},
                 {"learning_rate": 1e-5, "model_name_or_path": models[0]},
                 {"learning_rate": 3e-3, "model_name_or_path": models[1]},
                 {"learning_rate": 3e-3, "model_name_or_path": models[0]}],
    )  # fmt: skip
    # Each update made 0.25 s longer (tests/fault_hooks): a tiny model would otherwise finish its
    # epochs before the sweep's next look at its evaluations.
    env = {**os.environ, "PYTHONPATH": str(FAULT_HOOKS), "FT_ACCUM_SLOW_UPDATE_SECONDS": "0.25"}
    result = subprocess.run(sweep_command(path), capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # 1: a trial failed
    trials = load_study(tmp_path).get_trials()
    assert len(trials) == 4
    good, bad, broken, repeat = trials
    assert (repeat.state.name, repeat.value, repeat.user_attrs["same_as"]) == ("COMPLETE", good.value, "trial_0000")
    assert not (tmp_path / "search_out" / "trial_0003").exists()
    assert (good.state.name, bad.state.name, broken.state.name) == ("COMPLETE", "PRUNED", "FAIL"), result.stdout
    assert (
        broken.user_attrs["error"].startswith("error: --model_name_or_path")
        and "does not exist" in broken.user_attrs["error"]
    )
    assert len(good.intermediate_values) == 2 and list(bad.intermediate_values) == [0]
    assert bad.intermediate_values[0] > good.intermediate_values[0]
    assert (
        good.value
        == json.loads((tmp_path / "search_out" / "trial_0000" / "all_results.json").read_text())["eval_loss"]
    )
    # The pruned run stopped at a checkpoint (SIGTERM: exit 143), before its second epoch's evaluation.
    pruned_dir = tmp_path / "search_out" / "trial_0001"
    assert not (pruned_dir / "all_results.json").exists() and any((pruned_dir / "checkpoints").glob("step_*"))
    assert "stopped by SIGTERM" in (pruned_dir / "log.txt").read_text()
    results = (tmp_path / "search_out" / "results.md").read_text()
    assert "| trial_0001 | 1e-05 |" in results and "| pruned |" in results and "final LR" in results
    assert "| fail (error: --model_name_or_path" in results
    best = min((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert f"Best: trial_{best.number:04d}" in results and f"--learning_rate={best.params['learning_rate']}" in results

    # The resume command it left finishes the run from that checkpoint (its flags, run in this process:
    # a launch more would cost the suite 10 s of start-up for what the kill test launches anyway).
    resume = shlex.split(bad.user_attrs["resume_command"])
    assert resume[:2] == ["ft-accum", "launch"] and resume[-2:] == ["--resume_from_checkpoint", "latest"]
    recipe_flags = resume[resume.index(str(ROOT / "recipes" / "text_classification.py")) + 1 :]
    run_in_process("text_classification", [f for f in recipe_flags if f != "--config=none"])
    assert (pruned_dir / "all_results.json").exists() and len(read_metrics(pruned_dir)) == 12


def test_a_metric_the_recipe_never_logs_is_caught_at_the_first_evaluation(tmp_path):
    """The parent's reader of eval_metrics.jsonl, on the record a text-classification run writes. (Raised
    in the sweep, it fails the trial and ends the search with this line: run_search.)"""
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    record = {"epoch": 0, "step": 6, "eval_loss": 0.69, "eval_accuracy": 0.5, "eval_f1": 0.33}
    (tmp_path / "eval_metrics.jsonl").write_text(json.dumps(record) + "\n")
    search = {"metric": "eval_bleu"}
    reporter = search_trials.EvaluationReporter(trial, tmp_path, search, "text_classification.py", set())
    with pytest.raises(search_trials.MetricNotLogged) as error:
        reporter(process=None, began=0.0)
    assert str(error.value) == (
        "text_classification.py does not log eval_bleu at its evaluations; it logs eval_accuracy, eval_f1, "
        "eval_loss. Set search.metric to one of them"
    )
    search["metric"] = "eval_accuracy"  # a metric it logs is reported, once
    reporter(process=None, began=0.0)
    reporter(process=None, began=0.0)
    assert study.get_trials()[0].intermediate_values == {0: 0.5}


@pytest.mark.parametrize(
    "search, argv, message",
    [
        ({"space": {"learning_rat": {"low": 1e-5, "high": 1e-3}}}, [], "learning_rat is not a setting of text_classification.py"),
        ({"space": {"learning_rate": {"low": 1e-3, "high": 1e-5}}}, [], "the range 0.001..1e-05 is empty or inverted"),
        ({"space": {"learning_rate": {"low": 1e-3, "high": 1e-3}}}, [], "is empty or inverted; give low < high"),
        ({"space": {"effective_batch_size": {"choices": []}}}, [], "choices is empty"),
        ({"space": {}}, [], "search.space is empty"),
        ({"n_trials": 1, "enqueue": [{"learning_rate": 1e-4}] * 2}, [], "enqueue lists 2 trials, more than n_trials 1"),
        ({"sampler": "bayes"}, [], "sampler must be one of tpe, random, grid, cmaes"),
        ({"sampler": "grid", "n_trials": 4, "space": {"seed": {"choices": [1, 2]}}}, [], "the grid has 2 point(s), fewer than n_trials 4"),
        ({"storage": "sqlite:////no/such/dir/study.db"}, [], "cannot open the study storage sqlite:////no/such/dir"),
        ({"plan": {"model": "no-such-model", "task": "causal_lm", "seq_len": 64}}, [], "could not load the config of 'no-such-model'"),
        ({"storage": "postgresq://host/db"}, [], "cannot open the study storage postgresq://host/db"),
        ({"storage": "sqlite:///study.db"}, ["--worker"], "--worker needs a storage several sweeps can write at once"),
    ],
)  # fmt: skip
def test_search_bad_input_fails_before_any_trial_runs(tmp_path, tiny_model_dir, data_files, search, argv, message):
    path = write_search(tmp_path, tiny_model_dir, data_files, **search)
    with pytest.raises(SystemExit) as error:
        cli_main(["sweep", str(path), *argv])
    assert message in str(error.value) and str(error.value).startswith("error: "), str(error.value)
    assert not any((tmp_path / "search_out").glob("trial_*"))


def test_a_search_without_optuna_names_the_install(tmp_path, tiny_model_dir, data_files, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna now raises ImportError
    path = write_search(tmp_path, tiny_model_dir, data_files)
    with pytest.raises(SystemExit, match=r"needs Optuna, which is not installed; pip install -e \"\.\[search\]\""):
        cli_main(["sweep", str(path)])


def test_a_sampled_effective_batch_is_split_by_the_planner_or_the_base_micro_batch(tmp_path):
    # No plan: the largest micro-batch up to the base's that divides the effective batch per process.
    assert (
        search_trials.batch_settings({"effective_batch_size": 48, "per_device_train_batch_size": 16}, None, 8, 1)[
            "per_device_train_batch_size"
        ]
        == 16
    )
    split = search_trials.batch_settings(
        {"effective_batch_size": 24, "gradient_accumulation_steps": 4, "per_device_train_batch_size": 16}, None, 8, 2
    )
    assert split["per_device_train_batch_size"] == 12 and "gradient_accumulation_steps" not in split
    # A plan: the memory planner's recommendation for the search's GPU, whatever the base's micro-batch.
    from ft_accum.planner import memory_planner
    from ft_accum.testing import make_tiny_lm

    model = make_tiny_lm("gpt2", tmp_path / "tiny-gpt2")
    plan = {"model": str(model), "task": "causal_lm", "seq_len": 64, "gpu_memory": "12GiB", "precision": "fp32"}
    expected = memory_planner.plan(str(model), task="causal_lm", seq_len=64, effective_batch_size=32,
                                   gpu_memory_gib=12, precision="fp32")["recommended"]  # fmt: skip
    split = search_trials.batch_settings({"effective_batch_size": 32, "per_device_train_batch_size": 4}, plan, 8, 1)
    assert split["per_device_train_batch_size"] == expected["per_device_train_batch_size"] == 32  # all fit
    assert split.get("gradient_checkpointing", False) == expected["gradient_checkpointing"]


def test_the_final_learning_rate_follows_the_recipes_scaling():
    args = {"learning_rate": 1e-4, "effective_batch_size": 64, "base_batch_size": 16, "lr_scaling": "sqrt"}
    assert search_trials.final_learning_rate(args, 1) == pytest.approx(2e-4)
    assert search_trials.final_learning_rate({**args, "lr_scaling": "none"}, 1) == pytest.approx(1e-4)


def test_the_slurm_array_script_parses_and_runs_a_worker():
    script = ROOT / "examples" / "slurm_search.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "#SBATCH --array=" in text
    line = next(line for line in text.splitlines() if line.startswith("exec ft-accum sweep"))
    words = shlex.split(line.removeprefix("exec ").replace("$SWEEP_FILE", "sweeps/search.yaml"))
    args = build_parser().parse_args(words[1:])
    assert args.worker and args.handler.__name__ == "sweep_command"


def test_an_abandoned_trial_is_recognised_by_its_dead_owner():
    assert not search_study.owner_is_gone(search_study.this_process(), None, time.time())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = search_study.this_process().rsplit(":", 2)[0]
    assert search_study.owner_is_gone(f"{host}:{dead.pid}:1", None, time.time())
    # Another machine's sweep: alive while its heartbeat is fresh.
    assert not search_study.owner_is_gone("elsewhere:1:1", time.time() - 60, time.time())
    assert search_study.owner_is_gone("elsewhere:1:1", time.time() - search_study.STALE_SECONDS - 1, time.time())


@pytest.mark.parametrize("sampler", search_space.SAMPLERS)
def test_each_sampler_and_pruner_named_in_a_search_file_is_optunas(sampler):
    space = {"learning_rate": {"choices": [1e-4, 3e-4]}, "effective_batch_size": {"choices": [16, 32]}}
    search = {"sampler": sampler, "seed": 0, "space": search_space.load_search(
        {"n_trials": 2, "metric": "eval_loss", "space": space}, ROOT / "s.yaml",
        ROOT / "recipes" / "text_classification.py", sweep_module.recipe_settings(ROOT / "recipes" / "text_classification.py"),
    )["space"]}  # fmt: skip
    for pruner in ({"type": "median", "n_warmup_evaluations": 1}, {"type": "hyperband"}, {"type": "none"}):
        study = optuna.create_study(
            sampler=search_space.make_sampler(optuna, search), pruner=search_space.make_pruner(optuna, pruner)
        )
        for _ in range(2):
            trial = study.ask()
            values = search_space.sample(trial, search["space"])
            assert values["learning_rate"] in (1e-4, 3e-4) and values["effective_batch_size"] in (16, 32)
            study.tell(trial, 1.0)
    expected = {"tpe": "TPESampler", "random": "RandomSampler", "grid": "GridSampler", "cmaes": "CmaEsSampler"}
    assert type(search_space.make_sampler(optuna, search)).__name__ == expected[sampler]


def test_a_dry_run_of_a_search_writes_nothing(tmp_path, tiny_model_dir, data_files, capsys):
    path = write_search(tmp_path, tiny_model_dir, data_files)
    cli_main(["sweep", str(path), "--dry-run"])
    assert "search of text_classification.py: 4 trials, random sampler, median pruner" in capsys.readouterr().out
    assert not (tmp_path / "search_out").exists()


def test_a_repeated_sample_is_told_the_earlier_trials_end_without_a_run():
    space = {"learning_rate": {"choices": [1e-4, 3e-4]}}
    search = {"n_trials": 4, "space": space}
    study = optuna.create_study(direction="maximize")
    for params, values, state in (
        ({"learning_rate": 1e-4}, [0.5, 0.7], "COMPLETE"),
        ({"learning_rate": 3e-4}, [0.2], "PRUNED"),
    ):
        study.enqueue_trial(params)
        trial = study.ask()
        search_space.sample(trial, space)
        trial.set_user_attr("run", f"trial_{trial.number:04d}")
        for step, value in enumerate(values):
            trial.report(value, step)
        study.tell(trial, values[-1] if state == "COMPLETE" else None, state=getattr(optuna.trial.TrialState, state))
    for params in ({"learning_rate": 1e-4}, {"learning_rate": 3e-4}):
        study.enqueue_trial(params)
        trial = study.ask()
        assert search_trials.tell_repeat(optuna, study, trial, search_space.sample(trial, space), "x", search)
    first, pruned, repeat_first, repeat_pruned = study.get_trials()
    assert (repeat_first.state.name, repeat_first.value, repeat_first.intermediate_values) == (
        "COMPLETE",
        0.7,
        {0: 0.5, 1: 0.7},
    )
    assert repeat_pruned.state.name == "PRUNED" and repeat_pruned.intermediate_values == {0: 0.2}
    assert repeat_first.user_attrs["same_as"] == "trial_0000" and repeat_pruned.user_attrs["same_as"] == "trial_0001"


def test_a_trial_taken_up_whose_run_had_finished_is_recorded_from_its_results(tmp_path, monkeypatch):
    """The worker was killed after the trial's run wrote all_results.json and before the study recorded
    it: the worker that takes the trial up records the run's metric and runs nothing (launched again,
    the recipe would refuse the finished folder, and the trial would be marked failed: issue 64)."""
    from ft_accum.cli import launching

    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    (tmp_path / "trial_0000").mkdir()
    (tmp_path / "trial_0000" / "all_results.json").write_text(json.dumps({"eval_accuracy": 0.75}))
    monkeypatch.setattr(
        launching, "launch_and_watch", lambda *args, **kwargs: pytest.fail("ran a finished trial again")
    )
    search = {"metric": "eval_accuracy", "space": {"learning_rate": {"choices": [1e-4]}}, "n_trials": 1, "plan": None}
    sweep = {"search": search, "output_dir": str(tmp_path), "base": {}, "recipe": "recipes/text_classification.py",
             "timeout_per_run": 60}  # fmt: skip
    search_trials.run_trial(optuna, sweep, study, trial, taken_up=True, default_micro=8, num_processes=1)
    (recorded,) = study.get_trials()
    assert (recorded.state.name, recorded.value) == ("COMPLETE", 0.75)
