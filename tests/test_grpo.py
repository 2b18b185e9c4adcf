"""recipes/grpo.py: every split of an update gives the same update, for each loss type (issue 43).

A tiny Llama with SmolLM2's tokenizer whose EOS logit is large one way or the other
(`make_tiny_chat_lm(eos_scale=60)`): sampled completions stop early at some positions and run to
--max_completion_length at others. Its reward (`ft_accum.testing.varied_reward`) differs between
a prompt's completions, so the advantages, and the gradients, are not zero. SGD without clipping,
so an update is linear in its gradient and a wrong normaliser shows at its size. 3 updates of 8
completions (2 prompts × G = 4): the later rounds are sampled from the updated policy, so equal
completions across splits also show that the updates before them were equal.
The formulas themselves, against a direct full-batch evaluation and with bnpo as the control that
fails: tests/test_grpo_loss.py.
"""

import pytest
from conftest import RTOL, copy_checkpoint, error_of, final_weights, launch_runs, read_metrics, run_in_process

from ft_accum.data.rewards import arithmetic_task
from ft_accum.testing import make_tiny_chat_lm, relative_error, write_jsonl

pytestmark = pytest.mark.launch
SAME_COMPLETIONS = ("reward", "reward_std", "completion_length", "completion_length_max", "truncated_fraction")


@pytest.fixture(scope="module")
def eos_lm_dir(tmp_path_factory):
    return make_tiny_chat_lm(tmp_path_factory.mktemp("eos-lm"), eos_scale=60)


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts")
    return {"train": write_jsonl(path / "train.jsonl", arithmetic_task(16, seed=1).to_list()),
            "validation": write_jsonl(path / "val.jsonl", arithmetic_task(3, seed=2).to_list())}  # fmt: skip


def grpo_args(model, files, out, micro, accumulation=None, **settings):
    split = {"per_device_train_batch_size": micro, "effective_batch_size": 8}
    flags = {"model_name_or_path": model, "train_file": files["train"], "validation_file": files["validation"],
             "reward_funcs": "ft_accum.testing:varied_reward", "num_generations": 4, "max_completion_length": 8,
             "optim": "sgd", "learning_rate": 0.1, "max_grad_norm": 0, "lr_scaling": "none", "num_warmup_steps": 0,
             "max_train_steps": 3, "output_dir": out, "report_to": "none", "seed": 7, **split, **settings}  # fmt: skip
    return [f"--{k}={v}" for k, v in flags.items() if v is not None]


VARIANTS = {
    "dapo": {"loss_type": "dapo"},
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    # two updates per round: the second's ratio is clipped against the round's policy (old log-probs);
    # its 4 prompts sampled 3 a call: the groups {0, 1, 2} and {3}, one on each DDP process
    "dapo, 2 updates a round": {
        "loss_type": "dapo",
        "generation_batch_size": 16,
        "max_train_steps": 4,
        "generation_prompts_per_call": 3,
    },
}


def test_every_split_and_two_ddp_processes_make_the_same_updates(tmp_path, eos_lm_dir, prompt_files):
    """(8 × 1) = (2 × 4) = 2 DDP processes × (2 × 2) per loss type, and = (4 × 2) for the first: the same completions
    (their rewards and lengths at every update), losses, gradient norms and final weights."""
    outputs = {name: {} for name in VARIANTS}
    for name, settings in VARIANTS.items():
        # (4 × 2) once: a micro-batch of one whole group; (2 × 4) cuts each group in two, for every loss.
        for micro in (8, 2, 4) if name == next(iter(VARIANTS)) else (8, 2):
            out = tmp_path / name.replace(" ", "_").replace(",", "") / f"{micro}"
            run_in_process("grpo", grpo_args(eos_lm_dir, prompt_files, out, micro, **settings))
            outputs[name][f"{micro}"] = out
        outputs[name]["ddp"] = out.parent / "ddp"
    runs = [grpo_args(eos_lm_dir, prompt_files, outputs[n]["ddp"], 2, **s) for n, s in VARIANTS.items()]
    result = launch_runs("grpo", runs, num_processes=2, work_dir=tmp_path)
    assert result.stdout.count("2 processes") >= len(VARIANTS), result.stdout[-3000:]
    for name, out in outputs.items():
        full = read_metrics(out["8"])
        assert any(m["grad_norm"] > 0 for m in full) and any(0 < m["truncated_fraction"] < 1 for m in full), full
        for split in [s for s in ("2", "4", "ddp") if s in out]:
            ours = read_metrics(out[split])
            assert len(ours) == len(full), (name, split)
            for a, b in zip(ours, full):
                assert {k: a[k] for k in SAME_COMPLETIONS} == {k: b[k] for k in SAME_COMPLETIONS}, (name, split)
                assert a["loss"] == pytest.approx(b["loss"], rel=RTOL, abs=1e-7), (name, split)
                assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=RTOL), (name, split)
            error = relative_error(final_weights(out[split]), final_weights(out["8"]))
            assert error <= RTOL, (name, split, error)


def test_a_resume_at_a_rounds_end_is_bit_identical(tmp_path, eos_lm_dir, prompt_files):
    """The generation is seeded by (seed, round, prompt): the resumed run samples the same completions."""
    whole = tmp_path / "whole"
    run_in_process("grpo", grpo_args(eos_lm_dir, prompt_files, whole, 2, checkpointing_steps=2))
    resumed = copy_checkpoint(whole, 2, tmp_path / "resumed")
    run_in_process("grpo", grpo_args(eos_lm_dir, prompt_files, resumed, 2, checkpointing_steps=2,
                                     resume_from_checkpoint="latest"))  # fmt: skip
    timing = ("samples_per_second", "tokens_per_second")  # wall-clock rates: the only columns that may differ
    last, reference = read_metrics(resumed)[-1], read_metrics(whole)[-1]
    assert {k: v for k, v in last.items() if k not in timing} == {
        k: v for k, v in reference.items() if k not in timing
    }
    ours, theirs = final_weights(resumed), final_weights(whole)
    assert all((ours[k] == theirs[k]).all() for k in theirs)


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({"num_generations": 1}, "a group advantage needs ≥ 2 completions per prompt"),
        ({"generation_batch_size": 10}, "--generation_batch_size 10 must be a multiple of --num_generations 4"),
        ({"prompt_column": "question"}, "--prompt_column 'question' is not a column"),
        ({"max_completion_length": 0}, "--max_completion_length must be ≥ 1"),
        ({"generation_prompts_per_call": 0}, "--generation_prompts_per_call must be ≥ 1, got 0"),
        ({"reward_funcs": "no_such_module:f"}, "cannot import no_such_module"),
    ],
)
def test_bad_grpo_inputs_stop_with_one_line(tmp_path, eos_lm_dir, prompt_files, settings, fragment):
    message = error_of("grpo", grpo_args(eos_lm_dir, prompt_files, tmp_path / "out", 2, **settings))
    assert fragment in message and "\n" not in message, message
