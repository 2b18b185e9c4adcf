"""The shared recipe skeleton: every recipe offers every general feature. (A signal's graceful stop:
tests/test_launcher_stop.py through the launcher, tests/test_no_silent_failures.py with plain python.)"""

from conftest import ROOT, read_metrics, run_in_process, tiny_args

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))

# Every recipe offers every general feature: the flags are the shared TrainingArguments (parsed by the same
# code for every recipe), and what each recipe does with them is checked by behaviour, over every file in
# recipes/, by tests/test_recipe_contract.py (`ft-accum check`), not by matching hook names in its source.


def test_the_features_run_together_in_one_recipe(tmp_path, tiny_model_dir, data_files):
    """Schedule, noise scale, OOM retry (armed), sync_each_batch and checkpoints in one real run."""
    out = tmp_path / "all"
    results = run_in_process("text_classification", tiny_args(
        tiny_model_dir, data_files, out, per_device_train_batch_size=2, effective_batch_size=8, num_train_epochs=2,
        accumulation_schedule="epoch1:16", measure_noise_scale=True, auto_micro_batch=True, sync_each_batch=True,
        checkpointing_steps=2))  # fmt: skip
    records = read_metrics(out)
    assert {r["effective_batch_size"] for r in records} == {8, 16}
    assert all("noise_scale" in r for r in records)
    assert results["num_update_steps"] == len(records) and (out / "checkpoints").is_dir()
