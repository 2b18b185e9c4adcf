"""recipes/preference_tuning.py: DPO, SimPO and ORPO, each exact over the window against the full
batch, with LoRA and in full, on pairs whose responses differ 5× and more in length, with a short
last window, and under 2 real DDP processes on rows that do not divide evenly (issue 28)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import RTOL, copy_checkpoint, launch_runs, read_metrics, run_in_process, write_jsonl

from ft_accum.core.preference_loss import pair_terms
from ft_accum.data import chat_data
from ft_accum.testing import (
    counting_causal_lms,
    final_weights,
    make_preference_pairs,
    max_abs_difference,
    preference_args,
    relative_error,
)

VARIANTS = [("dpo", True), ("dpo", False), ("simpo", True), ("simpo", False), ("orpo", True), ("orpo", False)]


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs")
    return {
        "train": write_jsonl(path / "train.jsonl", make_preference_pairs(13, seed=5)),  # 8 + 5: a short last window
        "validation": write_jsonl(path / "validation.jsonl", make_preference_pairs(5, seed=6)),
    }


def test_response_labels_cover_the_response_only_even_after_an_assistant_turn_in_the_prompt(chat_lm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_lm_dir)
    row = {
        "prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "earlier answer"},
                   {"role": "user", "content": "b"}],
        "chosen": "the chosen answer", "rejected": [{"role": "assistant", "content": "no"}],
    }  # fmt: skip
    prompt, chosen, rejected = chat_data.preference_conversations(
        row, "explicit", ("prompt", "chosen", "rejected"), "row 1"
    )
    for response, text in ((chosen, "the chosen answer"), (rejected, "no")):
        ids, labels = chat_data.response_labels(tokenizer, prompt, response)
        labelled = tokenizer.decode([t for t in labels if t != -100])
        assert labelled.startswith(text) and "earlier" not in labelled, labelled


@pytest.mark.parametrize("row, words", [
    ({"prompt": "q", "chosen": "yes"}, "no 'rejected' (--rejected_column) column"),
    ({"prompt": "q", "chosen": "yes", "rejected": "  "}, "empty"),
    ({"question": "q", "good": "yes", "bad": "no"}, "the columns question, good, bad are in no preference format read here (prompt, chosen"),
])  # fmt: skip
def test_a_malformed_pair_is_one_error_line(tmp_path, chat_lm_dir, row, words):
    files = {
        "train": write_jsonl(tmp_path / "t.jsonl", [row] * 4),
        "validation": write_jsonl(tmp_path / "v.jsonl", [row]),
    }
    with pytest.raises(SystemExit) as exc:
        run_in_process("preference_tuning", preference_args(chat_lm_dir, files, tmp_path / "out", "dpo", False, 2, 1))
    message = str(exc.value.code)
    assert message.startswith("error: ") and "\n" not in message and words in message, message


def test_a_prompt_longer_than_max_seq_length_is_a_counted_skip(tmp_path, chat_lm_dir, capsys):
    """A pair whose prompt fills --max_seq_length keeps no response token: it is dropped, and the
    banner and all_results.json count it; the run goes on with the other pairs."""
    rows = make_preference_pairs(8, seed=4)
    rows[3] = {"prompt": "the " * 300, "chosen": "yes", "rejected": "no"}
    files = {
        "train": write_jsonl(tmp_path / "t.jsonl", rows),
        "validation": write_jsonl(tmp_path / "v.jsonl", rows[:2]),
    }
    results = run_in_process(
        "preference_tuning", preference_args(chat_lm_dir, files, tmp_path / "out", "dpo", True, 4, 1)
    )
    assert "1 dropped (no response token left)" in capsys.readouterr().out
    assert results["dropped_train_pairs"] == 1 and results["truncated_train_pairs"] == 1


def test_the_preference_formats_people_have_train_exactly_as_trls(tmp_path, chat_lm_dir, pair_files):
    """The same pairs in TRL's explicit-prompt format, TRL's implicit prompt (the turns chosen and
    rejected share), ShareGPT's (LLaMA-Factory's: conversations, then one {from, value} turn each)
    and Alpaca's (instruction, input, chosen, rejected): the four runs end bit-identical."""
    pairs = [(r["prompt"], r["chosen"], r["rejected"]) for r in make_preference_pairs(20, seed=9)]
    pairs = [pair for pair in pairs if isinstance(pair[0], str)][:10]
    formats = {
        "explicit": [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in pairs],
        "implicit": [{"chosen": [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                      "rejected": [{"role": "user", "content": p}, {"role": "assistant", "content": r}]}
                     for p, c, r in pairs],
        "sharegpt": [{"conversations": [{"from": "human", "value": p}], "chosen": {"from": "gpt", "value": c},
                      "rejected": {"from": "gpt", "value": r}} for p, c, r in pairs],
        "alpaca": [{"instruction": p, "input": "", "chosen": c, "rejected": r} for p, c, r in pairs],
    }  # fmt: skip
    weights = {}
    for name, rows in formats.items():
        files = {"train": write_jsonl(tmp_path / f"{name}.jsonl", rows), "validation": pair_files["validation"]}
        args = preference_args(chat_lm_dir, files, tmp_path / name, "dpo", True, 4, 1, "--max_train_steps=2")
        run_in_process("preference_tuning", args)
        weights[name] = final_weights(tmp_path / name)
    for name in ("implicit", "sharegpt", "alpaca"):
        assert max_abs_difference(weights[name], weights["explicit"]) == 0.0, name


def test_the_losses_follow_their_papers():
    """Against the formulas written out once more, on random log-probs: DPO's sigmoid of the reward
    difference, SimPO's length-normalised margin, ORPO's log odds ratio (as TRL computes it)."""
    torch.manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(5) * 20 - 1 for _ in range(4))
    nc, nr = torch.tensor([1.0, 4, 9, 30, 2]), torch.tensor([7.0, 2, 1, 3, 40])
    dpo = pair_terms("dpo", pc, pr, nc, nr, 0.1, rc, rr)
    assert torch.allclose(dpo.pair_losses, -F.logsigmoid(0.1 * ((pc - rc) - (pr - rr))))
    simpo = pair_terms("simpo", pc, pr, nc, nr, 2.0, simpo_gamma=1.0)
    assert torch.allclose(simpo.pair_losses, -F.logsigmoid(2.0 * (pc / nc - pr / nr) - 1.0))
    orpo = pair_terms("orpo", pc, pr, nc, nr, 0.1)
    odds = lambda lp, n: (lp / n).exp() / (1 - (lp / n).exp())  # noqa: E731
    assert torch.allclose(orpo.pair_losses, -0.1 * F.logsigmoid(torch.log(odds(pc, nc) / odds(pr, nr))), atol=1e-6)
    assert torch.allclose(orpo.chosen_nll, -pc)


def test_lora_dpo_starts_at_ln2_with_one_copy_of_the_model(tmp_path, chat_lm_dir, pair_files):
    """With LoRA the reference is the policy with its adapters off: the first loss is ln 2 (the
    policy equals its reference), and no second model is built or copied."""
    out = tmp_path / "lora"
    with counting_causal_lms() as models:
        results = run_in_process("preference_tuning", preference_args(chat_lm_dir, pair_files, out, "dpo", True, 4, 2))
    assert read_metrics(out)[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert results["initial_eval_reward_margin"] == 0.0
    assert models == {"built": ["LlamaForCausalLM"], "copied": []}, models
    # The report draws the rewards of each update and tabulates the evaluation's.
    from ft_accum.cli.main import main as cli_main

    cli_main(["report", str(out)])
    for name in ("reward_accuracy.png", "reward_margin.png"):
        assert (out / "report" / name).read_bytes()[:4] == b"\x89PNG", name
    assert "eval_reward_accuracy" in (out / "report" / "report.md").read_text()

    # Full fine-tuning keeps a frozen copy, and says so: the same count would catch it.
    with counting_causal_lms() as models:
        run_in_process(
            "preference_tuning", preference_args(chat_lm_dir, pair_files, tmp_path / "full", "dpo", False, 4, 2)
        )
    assert models == {"built": ["LlamaForCausalLM"], "copied": ["LlamaForCausalLM"]}, models


@pytest.mark.launch
def test_precomputed_reference_log_probs_equal_a_frozen_copy_and_resume_from_their_file(
    tmp_path, chat_lm_dir, pair_files
):
    """--precompute_ref_log_probs (full DPO): no copy of the model is made; the run at (2 × 4)
    equals the frozen-copy run at (8 × 1) within 1e-5; resumed after its first update from a copy of
    its checkpoint and its log-probs file, it ends bit-identical; without the file, one error line."""
    import shutil

    from ft_accum.training.reference_log_probs import FILE

    run = tmp_path / "precomputed"
    args = lambda out, micro, acc, *extra: preference_args(chat_lm_dir, pair_files, out, "dpo", False, micro, acc,  # noqa: E731
                                                          "--checkpointing_steps=1", *extra)  # fmt: skip
    with counting_causal_lms() as models:
        run_in_process("preference_tuning", args(run, 2, 4, "--precompute_ref_log_probs"))
    assert not models["copied"], models
    run_in_process("preference_tuning", args(tmp_path / "frozen_copy", 8, 1))
    ours, theirs = read_metrics(run), read_metrics(tmp_path / "frozen_copy")
    assert [m["samples_seen"] for m in ours] == [8, 13] and ours[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=RTOL) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=RTOL
        )
    assert relative_error(final_weights(run), final_weights(tmp_path / "frozen_copy")) <= RTOL

    resumed = copy_checkpoint(run, 1, tmp_path / "resumed")
    shutil.copy(run / FILE, resumed / FILE)
    run_in_process(
        "preference_tuning", args(resumed, 2, 4, "--precompute_ref_log_probs", "--resume_from_checkpoint=latest")
    )
    assert max_abs_difference(final_weights(resumed), final_weights(run)) == 0.0
    with pytest.raises(SystemExit, match="^error: --precompute_ref_log_probs: simpo is reference-free"):
        run_in_process(
            "preference_tuning", [*args(tmp_path / "simpo", 2, 4, "--precompute_ref_log_probs"), "--loss=simpo"]
        )
    lost = copy_checkpoint(run, 1, tmp_path / "lost")
    with pytest.raises(SystemExit, match=f"^error: --precompute_ref_log_probs: .*{FILE} is missing"):
        run_in_process(
            "preference_tuning", args(lost, 2, 4, "--precompute_ref_log_probs", "--resume_from_checkpoint=latest")
        )


@pytest.mark.launch
def test_split_windows_and_two_ddp_processes_equal_the_full_batch(tmp_path, chat_lm_dir, pair_files):
    """(8 × 1) = (2 × 4) = 2 processes × (2 × 2) for DPO, SimPO and ORPO, each with LoRA and in full,
    through `accelerate launch`: 13 pairs leave a short last window of 5 pairs (micro-batches of 2,
    2 and 1 at 2 × 4; 3 pairs on process 0 and 2 on process 1, whose second micro-batch is only
    Accelerate's repeats); responses differ 5× and more. The six DDP runs share one launch
    (ft_accum/testing/recipe_runs.py)."""
    runs = {variant: {} for variant in VARIANTS}
    for (loss, use_lora), outputs in runs.items():
        for micro, accumulation in ((8, 1), (2, 4)):
            out = tmp_path / f"{loss}-{'lora' if use_lora else 'full'}" / f"{micro}x{accumulation}"
            run_in_process(
                "preference_tuning",
                preference_args(chat_lm_dir, pair_files, out, loss, use_lora, micro, accumulation),
            )
            outputs[f"{micro}x{accumulation}"] = out
        outputs["ddp"] = out.parent / "ddp"
    # Each loss on 2 processes: DPO's two references (the LoRA model with its adapters off inside
    # the DDP wrapper, and a frozen copy outside it), ORPO's NLL term divided by the window's chosen
    # tokens summed over the processes, SimPO's length-normalised rewards of uneven shards.
    result = launch_runs(
        "preference_tuning",
        [preference_args(chat_lm_dir, pair_files, runs[v]["ddp"], *v, 2, 2) for v in VARIANTS],
        num_processes=2,
        work_dir=tmp_path,
    )
    assert result.stdout.count("2 processes") >= len(VARIANTS), result.stdout[-3000:]
    for variant, outputs in runs.items():
        assert json.loads((outputs["ddp"] / "all_results.json").read_text())["num_processes"] == 2
        full, full_metrics = final_weights(outputs["8x1"]), read_metrics(outputs["8x1"])
        assert [m["samples_seen"] for m in full_metrics] == [8, 13]
        for key in ("2x4", "ddp"):
            metrics = read_metrics(outputs[key])
            assert [m["samples_seen"] for m in metrics] == [8, 13], (variant, key)
            error = relative_error(final_weights(outputs[key]), full)
            assert error <= RTOL, (variant, key, error)
            for ours, theirs in zip(metrics, full_metrics):
                assert ours["loss"] == pytest.approx(theirs["loss"], rel=RTOL), (variant, key)
                assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=RTOL), (variant, key)
                assert ours["reward_accuracy"] == theirs["reward_accuracy"], (variant, key)
                # a difference of two rewards of ~1: its relative error is not what fp32 summation order bounds
                assert ours["reward_margin"] == pytest.approx(theirs["reward_margin"], abs=1e-5), (variant, key)
