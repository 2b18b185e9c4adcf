"""Experiment trackers, real and offline (issue 65): what each one recorded, read back from its own store.

One short run of the classification recipe per tracker (3 updates of 4 × 2, an evaluation after
update 2 and at the end); the tracker's record, read through its own files or client, holds every
number of every metrics.jsonl line and eval_metrics.jsonl line at its update, under the same names,
and the run's settings with the batch split the run made (effective batch, micro-batch,
accumulation, processes) and the LR scaled to it:
- TensorBoard: its event files, through tensorboard's EventAccumulator;
- Weights & Biases, offline (the default here: nothing leaves the machine): the offline run file,
  through `ft_accum.testing.wandb_offline` (wandb's own protobuf records);
- MLflow, its SQLite store in --output_dir: `MlflowClient.get_metric_history` and the run's params;
- Trackio, its local SQLite: the metrics and configs tables.
"""

import json
import sqlite3
from pathlib import Path

import pytest
import yaml
from conftest import read_evaluations, read_metrics, run_in_process, tiny_args

from ft_accum.core.errors import ConfigError
from ft_accum.training import run_outputs

PROJECT = "text_classification"  # the recipe's tracker project


def tensorboard_record(out: Path) -> tuple[dict, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged: dict[int, dict] = {}
    for folder in {p.parent for p in out.rglob("events.out.tfevents.*")}:
        events = EventAccumulator(str(folder))
        events.Reload()
        for tag in events.Tags()["scalars"]:
            for event in events.Scalars(tag):
                logged.setdefault(event.step, {})[tag] = event.value
    # The settings: TensorBoard's hparams, which Accelerate also writes out as hparams.yml beside the events.
    (hparams,) = out.rglob("hparams.yml")
    return logged, yaml.safe_load(hparams.read_text())


def wandb_record(out: Path) -> tuple[dict, dict]:
    from ft_accum.testing.wandb_offline import read_offline_run

    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    config, history = read_offline_run(run_file)
    return {row["_step"]: row for row in history}, config


def mlflow_record(out: Path) -> tuple[dict, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])
    logged: dict[int, dict] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            logged.setdefault(metric.step, {})[key] = metric.value
    return logged, {k: json.loads(v) if v[:1].isdigit() else v for k, v in run.data.params.items()}


def trackio_record(out: Path) -> tuple[dict, dict]:
    with sqlite3.connect(out.parent / "trackio" / f"{PROJECT}.db") as db:
        logged: dict[int, dict] = {}
        for step, values in db.execute("SELECT step, metrics FROM metrics ORDER BY id"):
            logged.setdefault(step, {}).update(json.loads(values))
        (config,) = [json.loads(c) for (c,) in db.execute("SELECT config FROM configs")]
    return logged, config


RECORDS = {
    "tensorboard": tensorboard_record,
    "wandb": wandb_record,
    "mlflow": mlflow_record,
    "trackio": trackio_record,
}


@pytest.mark.parametrize("tracker", sorted(RECORDS))
def test_each_tracker_records_what_metrics_jsonl_holds(tracker, tmp_path, tiny_model_dir, data_files, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported: the run's first
    out = tmp_path / "run"
    split = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "base_batch_size": 4}
    run_in_process(PROJECT, tiny_args(tiny_model_dir, data_files, out, **split, lr_scaling="linear",
                                      max_train_steps=3, eval_steps=2, report_to=tracker))  # fmt: skip
    logged, config = RECORDS[tracker](out)
    expected = [*read_metrics(out), *read_evaluations(out)]
    assert len(read_metrics(out)) == 3
    assert [e["step"] for e in read_evaluations(out)] == [2, 3]
    for record in expected:  # an evaluation's line also holds its epoch as a whole number: the update's is logged
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "epoch")}
        numbers |= {"epoch": record["epoch"]} if "loss" in record else {}
        for key, value in numbers.items():  # rel 1e-6: TensorBoard keeps float32, the others the number itself
            assert logged[record["step"]][key] == pytest.approx(value, rel=1e-6), (tracker, record["step"], key)
    results = json.loads((out / "all_results.json").read_text())
    assert (config["effective_batch_size"], config["per_device_train_batch_size"]) == (8, 4), config
    assert (config["gradient_accumulation_steps"], config["num_processes"]) == (2, 1), config
    assert config["scaled_learning_rate"] == pytest.approx(results["learning_rate"]) == 2e-3  # 1e-3 × 8 / 4


def test_a_tracker_that_is_not_installed_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(
        ConfigError, match=r"--report_to wandb needs the wandb package: pip install 'ft-accum\[wandb\]'"
    ):
        run_outputs.resolve_report_to("wandb")
