"""GRPO against TRL: how far each toolkit's update is from the full-batch formula (issue 43).

    pip install trl==1.16.0          # a benchmark dependency only ([bench] extra), never a runtime one
    python benchmarks/bench_trl_grpo.py [--output benchmarks/results/trl_grpo.json]

Both toolkits train the same tiny Llama (SmolLM2-135M-Instruct's tokenizer and chat template, 2
layers of width 32, `ft_accum.testing.make_tiny_chat_lm`) on the same 8 prompts, with the same
fixed completions and rewards: each prompt's G = 4 completions are drawn once (3 to 48 tokens, a
quarter of them truncated at --max_completion_length 48, the rest ending in EOS), and each has a
fixed reward. Generation is replaced, not run: TRL's through its public `rollout_func`, ours by
patching `generation_round.sample_prompts`, the one function that samples. fp32 on the CPU, SGD (momentum
0.9) at a constant LR, no clipping, β = 0, 4 updates of 8 completions.

Each toolkit's micro-batches are recorded as it trains them (which completions, their advantages),
and the full-batch formula is replayed on that same partition, one sequence at a time in plain
PyTorch: for each round, the old log-probs at the round's start; for each update, the loss over
all of its completions (dapo: token sum / token count; grpo: mean of sequence token means;
dr_grpo: token sum / (N · 48); TRL's bnpo has the dapo formula as its full batch), and an SGD step.
The figure is ‖θ_toolkit − θ_formula‖ / ‖θ_formula − θ₀‖: how far the toolkit ends from the
formula, as a fraction of how far training moved the weights. Exact accumulation gives fp32
rounding (~1e-6).

Rows: one update per round (TRL's `steps_per_generation` = accumulation; ours
`--generation_batch_size` = the effective batch) and two updates per round, at (8 × 1), (2 × 4)
and (4 × 2). Then the time per update, ours over TRL's, on a wider model (width 256) at (2 × 4):
the same completions, the same SGD, each toolkit's whole train loop (its rollout is the fixed one).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ft_accum.data.chat_data import render_ids  # noqa: E402
from ft_accum.data.rewards import arithmetic_task  # noqa: E402
from ft_accum.testing import (  # noqa: E402
    final_weights,
    load_recipe,
    make_tiny_chat_lm,
    reset_accelerate_state,
    write_jsonl,
)
from ft_accum.training import generation_round  # noqa: E402

G, MAX_LENGTH, EFFECTIVE, UPDATES = 4, 48, 8, 4
LEARNING_RATE, MOMENTUM = 0.1, 0.9  # --optim sgd is torch's SGD at momentum 0.9; TRL's gets it by optim_args
SPLITS = [(8, 1), (2, 4), (4, 2)]
REWARDS: dict[str, float] = {}  # completion text -> its fixed reward (both toolkits' reward function)
COMPLETIONS: dict[tuple, list[tuple[list[int], bool]]] = {}  # prompt ids -> its G (ids, truncated)


def fixed_reward(prompts, completions, **columns) -> list[float]:
    """The reward function of both toolkits: the fixed reward of each completion's text. Our recipe's
    held-out evaluation scores its own greedy answers too; those are not fixed, and score 0."""
    return [REWARDS.get(reward_key(c if isinstance(c, str) else c[0]["content"]), 0.0) for c in completions]


def reward_key(text: str) -> str:
    """The completion's letters and digits: the toolkits' decoders may differ in spaces and stray bytes."""
    return "".join(ch for ch in text if ch.isalnum())


def make_task(tokenizer, n_prompts: int) -> list[dict]:
    """n_prompts distinct arithmetic questions of one token length (no left padding: TRL's logits then see the
    positions ours do), each with G fixed completions and rewards, registered in COMPLETIONS, REWARDS."""
    rows, length = [], None
    for row in arithmetic_task(200, seed=3).to_list():
        ids = render_ids(tokenizer, row["prompt"], add_generation_prompt=True)  # as recipes/grpo.py renders
        length = length or len(ids)
        if len(ids) == length and all(ids != kept for _, kept in rows):
            rows.append((row, ids))
        if len(rows) == n_prompts:
            break
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    for _, ids in rows:
        group = []
        for _ in range(G):
            truncated = rng.random() < 0.25
            size = MAX_LENGTH if truncated else rng.randint(3, MAX_LENGTH)
            tokens = [t for t in rng.sample(range(1000, 40000), size + 8) if t not in special][
                : size - (not truncated)
            ]
            tokens += [] if truncated else [tokenizer.eos_token_id]
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            assert reward_key(text) not in REWARDS, "two completions decode alike"
            REWARDS[reward_key(text)] = rng.uniform(0.0, 1.0)
            group.append((tokens, truncated))
        COMPLETIONS[tuple(ids)] = group
    return [row for row, _ in rows]


# ---- the full-batch formula, replayed on a toolkit's recorded partition ----


def sequence_log_probs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log π(o_t | prompt, o_<t) for each completion token, one unpadded sequence."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def formula_weights(model_dir: Path, rounds: list[list[list[tuple]]], loss_type: str) -> dict[str, torch.Tensor]:
    """θ after SGD on each update's full-batch loss, in the toolkit's own order; `rounds` holds the
    updates of each round, each a list of (prompt ids, completion ids, advantage)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    for updates in rounds:
        with torch.no_grad():
            old = [[sequence_log_probs(model, p, c) for p, c, _ in update] for update in updates]
        for update, old_logps in zip(updates, old):
            optimizer.zero_grad()
            terms = []
            for (prompt, completion, advantage), old_lp in zip(update, old_logps):
                ratio = torch.exp(sequence_log_probs(model, prompt, completion) - old_lp)
                terms.append(-torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage))
            if loss_type in ("dapo", "bnpo"):
                loss = sum(t.sum() for t in terms) / sum(len(t) for t in terms)
            elif loss_type == "grpo":
                loss = sum(t.mean() for t in terms) / len(terms)
            else:  # dr_grpo
                loss = sum(t.sum() for t in terms) / (len(terms) * MAX_LENGTH)
            loss.backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def group_updates(micro_batches: list[list[tuple]], accumulation: int, updates_per_round: int) -> list:
    updates = [sum(micro_batches[i : i + accumulation], []) for i in range(0, len(micro_batches), accumulation)]
    return [updates[i : i + updates_per_round] for i in range(0, len(updates), updates_per_round)]


def distance(ours: dict, formula: dict, start: dict) -> float:
    keys = [k for k in formula if k in ours]
    off = sum(float((ours[k].double() - formula[k].double()).pow(2).sum()) for k in keys) ** 0.5
    moved = sum(float((formula[k].double() - start[k].double()).pow(2).sum()) for k in keys) ** 0.5
    return off / moved


# ---- the two toolkits, each recording the micro-batches it trains ----


def trl_run(model_dir, rows, loss_type, micro, accumulation, updates_per_round, work):
    """(final weights, recorded micro-batches, train seconds) of TRL's GRPOTrainer."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def rollout(prompts, trainer):  # the fixed completions, in the order the repeated prompts come
        ids = [render_ids(tokenizer, p, add_generation_prompt=True) for p in prompts]
        seen: dict[tuple, int] = {}
        completions = []
        for prompt in ids:
            g = seen[tuple(prompt)] = seen.get(tuple(prompt), -1) + 1
            completions.append(COMPLETIONS[tuple(prompt)][g][0])
        return {"prompt_ids": ids, "completion_ids": completions, "logprobs": None}

    config = GRPOConfig(
        output_dir=str(work), per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation * updates_per_round, num_generations=G, max_completion_length=MAX_LENGTH,
        loss_type=loss_type, beta=0.0, learning_rate=LEARNING_RATE, optim="sgd", optim_args=f"momentum={MOMENTUM}",
        lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, max_steps=UPDATES, shuffle_dataset=False,
        temperature=1.0, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0,
        disable_tqdm=True, gradient_checkpointing=False, bf16=False,  # TRL's defaults: checkpointing, bf16 autocast
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    trainer = GRPOTrainer(model=model, reward_funcs=[fixed_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, rollout_func=rollout)  # fmt: skip
    recorded, compute_loss = [], trainer._compute_loss

    def recording(model, inputs):
        batch = []
        for i in range(len(inputs["completion_ids"])):
            prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
            completion = inputs["completion_ids"][i][inputs["completion_mask"][i].bool()].tolist()
            batch.append((prompt, completion, float(inputs["advantages"][i])))
        recorded.append(batch)
        return compute_loss(model, inputs)

    trainer._compute_loss = recording
    seconds = trainer.train().metrics["train_runtime"]
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    reset_accelerate_state()
    return weights, recorded, seconds


def our_run(model_dir, files, loss_type, micro, updates_per_round, work):
    """(final weights, recorded micro-batches, train seconds) of recipes/grpo.py, run in-process."""
    recipe = load_recipe("grpo")
    recorded, training_step = [], recipe.training_step

    def recording(task, accelerator, model, reference, batch):
        prompt_width = batch["input_ids"].shape[1] - batch["completion_ids"].shape[1]
        recorded.append([
            (batch["input_ids"][i, :prompt_width][batch["attention_mask"][i, :prompt_width].bool()].tolist(),
             batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist(), float(batch["advantages"][i]))
            for i in range(len(batch["completion_ids"]))
        ])  # fmt: skip
        return training_step(task, accelerator, model, reference, batch)

    def fixed_sample(accelerator, model, prompts, sampling, seed):
        return [COMPLETIONS[tuple(prompt_ids)] for prompt_ids in prompts]

    flags = {
        "model_name_or_path": model_dir, "train_file": files["train"], "validation_file": files["validation"],
        "reward_funcs": f"{__name__}:fixed_reward", "num_generations": G, "max_completion_length": MAX_LENGTH,
        "loss_type": loss_type, "per_device_train_batch_size": micro, "effective_batch_size": EFFECTIVE,
        "generation_batch_size": EFFECTIVE * updates_per_round, "temperature": 1.0, "optim": "sgd",
        "learning_rate": LEARNING_RATE, "lr_scaling": "none", "lr_scheduler_type": "constant",
        "num_warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 0, "max_train_steps": UPDATES,
        "output_dir": work, "report_to": "none", "seed": 0,
    }  # fmt: skip
    recipe.training_step, sample = recording, generation_round.sample_prompts
    generation_round.sample_prompts = fixed_sample
    try:
        recipe.main(["--config=none", *(f"--{k}={v}" for k, v in flags.items())])
    finally:
        generation_round.sample_prompts = sample
        reset_accelerate_state()
    seconds = json.loads((Path(work) / "all_results.json").read_text())["train_runtime"]
    return final_weights(Path(work)), recorded, seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--timing_repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows_out, timing = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = make_tiny_chat_lm(tmp / "model")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = make_task(tokenizer, 8 + 1)
        files = {"train": write_jsonl(tmp / "train.jsonl", prompts[:8]),
                 "validation": write_jsonl(tmp / "val.jsonl", prompts[8:])}  # fmt: skip
        start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        lengths = [len(c) for group in COMPLETIONS.values() for c, _ in group]
        print(f"{len(lengths)} fixed completions of {min(lengths)}–{max(lengths)} tokens, "
              f"{sum(t for g in COMPLETIONS.values() for _, t in g)} truncated")  # fmt: skip
        runs = [("TRL", loss) for loss in ("dapo", "bnpo", "grpo", "dr_grpo")]
        runs += [("ours", loss) for loss in ("dapo", "grpo", "dr_grpo")]
        for updates_per_round in (1, 2):
            for toolkit, loss in runs:
                for micro, accumulation in SPLITS:
                    work = tmp / f"{toolkit}-{loss}-{updates_per_round}-{micro}"
                    if toolkit == "TRL":
                        weights, recorded, _ = trl_run(
                            model_dir, prompts[:8], loss, micro, accumulation, updates_per_round, work
                        )
                    else:
                        weights, recorded, _ = our_run(model_dir, files, loss, micro, updates_per_round, work)
                    rounds = group_updates(recorded, accumulation, updates_per_round)
                    assert sum(len(r) for r in rounds) == UPDATES, (toolkit, loss, len(recorded))
                    error = distance(weights, formula_weights(model_dir, rounds, loss), start)
                    row = {"toolkit": toolkit, "loss_type": loss, "updates_per_round": updates_per_round,
                           "split": f"{micro} × {accumulation}", "off_the_formula": error}  # fmt: skip
                    rows_out.append(row)
                    print(f"{toolkit:5s} {loss:8s} {updates_per_round} update(s)/round {micro} × {accumulation}: "
                          f"{100 * error:.4g}% of the update off the formula", flush=True)  # fmt: skip

        wide_dir = make_tiny_chat_lm(tmp / "wide", width=256)
        seconds = {"TRL": [], "ours": []}
        for repeat in range(args.timing_repeats):
            seconds["TRL"].append(trl_run(wide_dir, prompts[:8], "dapo", 2, 4, 1, tmp / f"t-trl-{repeat}")[2])
            seconds["ours"].append(our_run(wide_dir, files, "dapo", 2, 1, tmp / f"t-ours-{repeat}")[2])
        timing = {k: statistics.median(v) / UPDATES for k, v in seconds.items()}
        timing["ours_over_trl"] = timing["ours"] / timing["TRL"]
        timing["all_seconds"] = seconds
        print(f"time per update at 2 × 4, width 256: ours {timing['ours']:.3f} s, TRL {timing['TRL']:.3f} s, "
              f"ours / TRL = {timing['ours_over_trl']:.2f}")  # fmt: skip

    import trl

    result = {"trl_version": trl.__version__, "torch_version": torch.__version__, "rows": rows_out,
              "time_per_update": timing, "completion_lengths": lengths}  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
