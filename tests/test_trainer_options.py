"""The Trainer's options, exact (issue 65): early stopping, the best model, NEFTune.

Each claim is checked against what the run itself logged (eval_metrics.jsonl: one line per
evaluation, with its update), on the tiny BERT classifier:
- early stopping stops after the update a hand computation from the logged evaluations predicts, and a
  run SIGKILLed after its first evaluation and resumed stops there too, with bit-identical final/;
- --load_best_model_at_end: final/ is the best evaluation's checkpoint, which --save_total_limit kept;
- NEFTune's noise gives the same gradient at (8 × 1) and (2 × 4), where transformers' hook does not.
Where the options meet the shared machinery on several processes, they ride in the launches that are
there already: --eval_steps and early stopping on 2 DDP processes in tests/test_text_classification.py,
--label_smoothing and --neftune_noise_alpha at three splits and a resume in tests/test_instruction_tuning.py.
"""

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import (
    FAULT_HOOKS,
    final_weights,
    kill_when,
    launch_command,
    make_rows,
    make_tiny_lm,
    max_abs_difference,
    read_evaluations,
    relative_error,
    run_in_process,
    tiny_args,
    write_jsonl,
)
from safetensors.torch import load_file

from ft_accum.core.loss_normalization import causal_lm_loss_sum
from ft_accum.models.neftune import add_neftune_noise

# 4 samples per update over 47 rows: 12 updates an epoch, the last of 3 rows.
SPLIT = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
RUN = {"num_train_epochs": 2, "max_train_samples": 47}


@pytest.fixture(scope="module")
def data(tmp_path_factory, data_files):
    train = write_jsonl(tmp_path_factory.mktemp("options-data") / "train.jsonl", make_rows(64, seed=3))
    return {**data_files, "train": train}


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
def test_early_stopping_stops_where_the_evaluations_say_and_a_killed_resumed_run_stops_there_too(
    tmp_path, tiny_model_dir, data
):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    settings = {**SPLIT, **RUN, "eval_steps": 2, "checkpointing_steps": 2, "learning_rate": 3e-3}
    rule = {"metric_for_best_model": "accuracy", "early_stopping_patience": 3, "early_stopping_threshold": 0.05}
    run_in_process("text_classification", tiny_args(tiny_model_dir, data, whole, **settings, **rule))
    expected = stop_by_hand(read_evaluations(whole), "eval_accuracy", 3, 0.05, greater=True)
    assert expected is not None and expected < 24, read_evaluations(whole)  # the rule stops this run early
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
    settings = {**SPLIT, **RUN, "eval_steps": 3, "checkpointing_steps": 3, "save_total_limit": 1}
    run_in_process("text_classification", tiny_args(tiny_model_dir, data, out, **settings, **rule))
    evals = read_evaluations(out)
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
