"""The Trainer's options, exact (issue 65): evaluation every N updates, early stopping and the best model.

Each claim is checked against what the run itself logged (eval_metrics.jsonl: one line per
evaluation, with its update) and against a run without the option, on the tiny BERT classifier:
- --eval_steps evaluates after every N-th update and at each epoch's end, and nothing else; with 2 DDP
  processes (a short last window) the updates are those of one process's run without it (≤ 1e-5),
  and early stopping ends both processes at the same update (the launch exits 0: no hang);
- early stopping stops after the update a hand computation from the logged evaluations predicts, and a
  run SIGKILLed after its first evaluation and resumed stops there too, with bit-identical final/;
- --load_best_model_at_end: final/ is the best evaluation's checkpoint, which --save_total_limit kept.
"""

import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    FAULT_HOOKS,
    ROOT,
    assert_same_run,
    final_weights,
    kill_when,
    launch,
    launch_command,
    make_rows,
    make_tiny_lm,
    max_abs_difference,
    relative_error,
    run_in_process,
    tiny_args,
    write_jsonl,
)
from safetensors.torch import load_file

from ft_accum.cli.check import check, format_table
from ft_accum.core.loss_normalization import causal_lm_loss_sum
from ft_accum.models.neftune import add_neftune_noise
from ft_accum.testing.generated_data import make_conversations
from ft_accum.training.run_outputs import EVAL_METRICS_FILE

# 4 samples per update over 47 rows: 12 updates an epoch, the last of 3 rows.
SPLIT = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
EVERY = {"num_train_epochs": 2, "max_train_samples": 47, "eval_steps": 5}


@pytest.fixture(scope="module")
def data(tmp_path_factory, data_files):
    train = write_jsonl(tmp_path_factory.mktemp("options-data") / "train.jsonl", make_rows(64, seed=3))
    return {**data_files, "train": train}


def evaluations(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / EVAL_METRICS_FILE).read_text().splitlines()]


def results(out: Path) -> dict:
    return json.loads((out / "all_results.json").read_text())


def stop_by_hand(evals: list[dict], metric: str, patience: int, threshold: float, greater: bool) -> int | None:
    """The update after which transformers' EarlyStoppingCallback would stop, from the logged evaluations."""
    best, waited = None, 0
    for record in evals:
        value = record[metric] if greater else -record[metric]
        waited = 0 if best is None or value - best > threshold else waited + 1
        best = value if best is None else max(best, value)
        if waited >= patience:
            return record["step"]
    return None


@pytest.mark.launch
def test_two_processes_evaluate_at_the_stated_updates_stop_together_and_make_the_same_updates(
    tmp_path, tiny_model_dir, data
):
    out, reference = tmp_path / "ddp", tmp_path / "reference"
    # No accuracy (the recipe's metric) can improve on the first by 10: patience 3 stops after the 4th evaluation.
    # A constant LR: the reference stops at update 15 by --max_train_steps, which would shorten a decay.
    stopping = {"early_stopping_patience": 3, "early_stopping_threshold": 10, "lr_scheduler_type": "constant"}
    ddp = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}  # × 2 processes: 4 per update
    result = launch("text_classification", tiny_args(tiny_model_dir, data, out, **ddp, **EVERY, **stopping), 2)
    assert [e["step"] for e in evaluations(out)] == [5, 10, 12, 15]  # every 5th update, and epoch 1's end (12)
    assert results(out)["num_processes"] == 2 and results(out)["stopped_early_at"] == 15
    assert results(out)["num_update_steps"] == 15 and "early stopping: eval_accuracy has not improved" in result.stdout
    assert re.search(r"^  early stopping +after 3 evaluation", result.stdout, re.M)  # the banner says it is on

    run_in_process("text_classification", tiny_args(tiny_model_dir, data, reference, **SPLIT, **EVERY | {
        "eval_steps": None, "max_train_steps": 15, "lr_scheduler_type": "constant"}))  # fmt: skip
    assert_same_run(out, reference)


@pytest.mark.launch
def test_early_stopping_stops_where_the_evaluations_say_and_a_killed_resumed_run_stops_there_too(
    tmp_path, tiny_model_dir, data
):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    settings = {**SPLIT, **EVERY, "eval_steps": 2, "checkpointing_steps": 2, "learning_rate": 3e-3}
    rule = {"metric_for_best_model": "accuracy", "early_stopping_patience": 3, "early_stopping_threshold": 0.05}
    run_in_process("text_classification", tiny_args(tiny_model_dir, data, whole, **settings, **rule))
    expected = stop_by_hand(evaluations(whole), "eval_accuracy", 3, 0.05, greater=True)
    assert expected is not None and expected < 24, evaluations(whole)  # the rule stops this run early
    assert results(whole)["stopped_early_at"] == expected == results(whole)["num_update_steps"]
    assert (whole / "final").is_dir() and (whole / "checkpoints" / f"step_{expected:06d}").is_dir()

    # Killed inside the write of the checkpoint after update 6: the resume starts from update 4's, whose
    # evaluation was the second (one without improvement, if the first was not beaten: the counter must be kept).
    frozen = tmp_path / "frozen"
    cmd, env = launch_command("text_classification", tiny_args(tiny_model_dir, data, killed, **settings, **rule))
    hooks = os.pathsep.join(filter(None, [str(FAULT_HOOKS), os.environ.get("PYTHONPATH")]))
    env |= {"PYTHONPATH": hooks, "FT_ACCUM_FREEZE_BEFORE_PUBLISHING": ".tmp-step_000006"}
    process = subprocess.Popen(cmd, env=env | {"FT_ACCUM_FROZEN_MARKER": str(frozen)}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    kill_when(process, frozen.exists, "the write of checkpoint 6")
    assert sorted(p.name for p in (killed / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]
    run_in_process(
        "text_classification",
        tiny_args(tiny_model_dir, data, killed, **settings, **rule, resume_from_checkpoint="latest"),
    )
    assert results(killed)["stopped_early_at"] == expected
    assert max_abs_difference(final_weights(killed), final_weights(whole)) == 0.0


def test_load_best_model_at_end_gives_the_best_evaluation_s_weights_kept_from_save_total_limit(
    tmp_path, tiny_model_dir, data
):
    out = tmp_path / "best"
    # The largest eval loss ranked best: an early evaluation, so final/ is not the last update's weights.
    rule = {"metric_for_best_model": "eval_loss", "greater_is_better": True, "load_best_model_at_end": True}
    settings = {**SPLIT, **EVERY, "eval_steps": 3, "checkpointing_steps": 3, "save_total_limit": 1}
    run_in_process("text_classification", tiny_args(tiny_model_dir, data, out, **settings, **rule))
    evals = evaluations(out)
    best = max(evals, key=lambda e: e["eval_loss"])["step"]
    assert best < evals[-1]["step"] and results(out)["final_weights_from_step"] == best, evals
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert kept == [f"step_{best:06d}", f"step_{evals[-1]['step']:06d}"]  # the newest, and the best despite the limit
    best_weights = load_file(out / "checkpoints" / kept[0] / "model.safetensors")
    assert max_abs_difference(final_weights(out), best_weights) == 0.0
    assert max_abs_difference(final_weights(out), load_file(out / "checkpoints" / kept[1] / "model.safetensors")) > 0


def window_gradient(model, rows: list[list[int]], micro: int, pad_id: int) -> torch.Tensor:
    """The gradient of Σ loss / T over the 8 rows as micro-batches of `micro`, each padded to its own longest row."""
    model.zero_grad()
    total = sum(len(r) - 1 for r in rows)
    for start in range(0, len(rows), micro):
        chunk = rows[start : start + micro]
        width = max(map(len, chunk))
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in chunk])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in chunk])
        loss_sum, _ = causal_lm_loss_sum(
            model(input_ids=ids, attention_mask=mask).logits, ids.masked_fill(mask == 0, -100)
        )
        (loss_sum / total).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_neftune_noise_is_the_same_update_at_any_split_where_transformers_hook_is_not(tmp_path):
    """8 rows of 4 to 29 tokens as (8 × 1) and (2 × 4): our noise gives one gradient (≤ 1e-5), transformers'
    hook two (its scale follows the padded length, its draws the micro-batch); no noise without gradients."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.neftune import neftune_post_forward_hook

    model = AutoModelForCausalLM.from_pretrained(make_tiny_lm("llama", tmp_path)).train()  # dropout 0
    generator = random.Random(5)
    rows = [[generator.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (29, 4, 17, 9, 23, 6, 12, 4)]
    pad = model.config.pad_token_id
    plain = window_gradient(model, rows, 8, pad)

    handles = add_neftune_noise(model, alpha=5.0, seed=7, current_update=lambda: 3)
    ids = torch.tensor([rows[0]])
    with torch.no_grad():
        noisy_eval = model(input_ids=ids).logits
    ours = {micro: window_gradient(model, rows, micro, pad) for micro in (8, 2)}
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        assert torch.equal(noisy_eval, model(input_ids=ids).logits)  # evaluation: no noise
    assert relative_error({"g": ours[8]}, {"g": plain}) > 1e-3  # the noise is there
    assert relative_error({"g": ours[2]}, {"g": ours[8]}) <= 1e-5

    embedding = model.get_input_embeddings()
    embedding.neftune_noise_alpha = 5.0
    embedding.register_forward_hook(neftune_post_forward_hook)
    theirs = {}
    for micro in (8, 2):
        torch.manual_seed(7)
        theirs[micro] = window_gradient(model, rows, micro, pad)
    assert relative_error({"g": theirs[2]}, {"g": theirs[8]}) > 1e-3


@pytest.mark.launch
def test_label_smoothing_and_neftune_accumulate_exactly_on_two_processes_and_resume(tmp_path, chat_lm_dir):
    """The instruction recipe (the chunked output loss) with --label_smoothing 0.1 and --neftune_noise_alpha 5,
    on conversations of unequal lengths: `ft-accum check` ((8 × 1) = (2 × 4), a bit-identical resume), and
    DDP 2 × (2 × 2) = (8 × 1) ≤ 1e-5."""
    files = {split: write_jsonl(tmp_path / f"{split}.jsonl", make_conversations(n, seed=s))
             for split, n, s in (("train", 20, 1), ("validation", 4, 2))}  # fmt: skip
    options = ["--label_smoothing=0.1", "--neftune_noise_alpha=5"]
    common = [f"--model_name_or_path={chat_lm_dir}", f"--train_file={files['train']}",
              f"--validation_file={files['validation']}", "--max_seq_length=96", "--max_new_tokens=2", *options]  # fmt: skip
    checks = check(ROOT / "recipes" / "instruction_tuning.py", common, fsdp=False)
    assert all(r.passed for r in checks), format_table(checks)

    one, two = tmp_path / "one", tmp_path / "two"
    settings = {"num_train_epochs": None, "max_train_steps": 2, "learning_rate": 1e-3, "lr_scaling": "none",
                "report_to": "none", "seed": 7, "weight_decay": 0.0}  # fmt: skip
    flags = [*common, *(f"--{k}={v}" for k, v in settings.items() if v is not None)]
    run_in_process("instruction_tuning", [*flags, f"--output_dir={one}", "--per_device_train_batch_size=8",
                                          "--gradient_accumulation_steps=1"])  # fmt: skip
    launch("instruction_tuning", [*flags, f"--output_dir={two}", "--per_device_train_batch_size=2",
                                  "--gradient_accumulation_steps=2"], num_processes=2)  # fmt: skip
    assert results(two)["num_processes"] == 2
    assert_same_run(two, one)
