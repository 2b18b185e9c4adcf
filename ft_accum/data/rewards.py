"""Verifiable rewards for online RL (issue 43): the bundled arithmetic task, its exact-answer
reward, and the loading and calling of the reward functions a run names.

A reward function takes `(prompts, completions, **columns)`, one entry per completion (the
dataset's other columns, such as `answer`, repeated for each of a prompt's completions), and
returns one float per completion: TRL's `reward_funcs` convention. `--reward_funcs
module:function[,module:function]` names them (the module importable from the working directory
or PYTHONPATH); `--reward_weights` weighs them. A function that raises, or returns a NaN or None,
stops the run with one line that names it and the row: a silent zero would train on a lie.
"""

from __future__ import annotations

import importlib
import math
import random
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import datasets

from ft_accum.core.errors import ConfigError

RewardFunction = Callable[..., list]
BUNDLED_REWARD = "ft_accum.data.rewards:exact_answer_reward"
INSTRUCTION = "Answer with the number only."


def arithmetic_task(num_prompts: int, seed: int, max_operand: int = 20) -> datasets.Dataset:
    """Prompts the project generates, with an answer a program can check: `a + b` or `a − b` with
    operands up to `max_operand`, as one user turn ("What is 7 + 12? Answer with the number only.")
    and the answer as text. The same seed gives the same prompts on every machine."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        plus = rng.random() < 0.5
        question = f"What is {a} + {b}? {INSTRUCTION}" if plus else f"What is {a} - {b}? {INSTRUCTION}"
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(a + b if plus else a - b)})
    return datasets.Dataset.from_list(rows)


def last_number(text: str) -> str | None:
    """The last integer in `text` (a leading minus kept), or None: the answer of "36", "The answer is 36."
    and "20 + 16 = 36" alike (SmolLM2-135M-Instruct mostly restates the sum before its answer)."""
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def exact_answer_reward(prompts: Sequence, completions: Sequence, answer: Sequence[str], **columns) -> list[float]:
    """1.0 where the completion's last number is the answer, else 0.0 (the verifiable reward of
    DeepSeek-R1 style training, on the bundled arithmetic task)."""
    return [float(last_number(text_of(c)) == str(a).strip()) for c, a in zip(completions, answer)]


def text_of(completion) -> str:
    """A completion as text: a string, or a list of chat messages (their contents joined)."""
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content", "") for message in completion)


def load_reward_functions(spec: str) -> list[tuple[str, RewardFunction]]:
    """`module:function[,module:function]` as [(name, function)], importing from the working directory
    too (as `python -m` would), with a one-line error for a module or function that is not there."""
    functions = []
    for item in (part.strip() for part in spec.split(",")):
        module_name, _, function_name = item.partition(":")
        if not module_name or not function_name:
            raise ConfigError(f"--reward_funcs {item!r} must be module:function, e.g. {BUNDLED_REWARD}")
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(
                f"--reward_funcs: cannot import {module_name} ({exc}); put {module_name}.py in the working directory "
                "or on PYTHONPATH"
            ) from None
        function = getattr(module, function_name, None)
        if not callable(function):
            raise ConfigError(f"--reward_funcs: {module_name} has no function {function_name}")
        functions.append((item, function))
    return functions


def reward_weights(weights: str | None, count: int) -> list[float]:
    """`--reward_weights 1.0,0.5` as floats, one per reward function (all 1.0 when not given)."""
    if not weights:
        return [1.0] * count
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise ConfigError(f"--reward_weights {weights!r} must be numbers separated by commas, e.g. 1.0,0.5") from None
    if len(values) != count:
        raise ConfigError(
            f"--reward_weights gives {len(values)} weights for {count} reward function(s); give one each"
        )
    return values


def score(
    functions: list[tuple[str, RewardFunction]],
    prompts: Sequence,
    completions: Sequence,
    columns: dict[str, Sequence],
) -> list[list[float]]:
    """Each function's rewards for the completions, [function][completion], checked: one finite number
    per completion. A function that raises is called row by row to name the first row it fails on."""
    scores = []
    for name, function in functions:
        try:
            values = function(prompts=prompts, completions=completions, **columns)
        except Exception as exc:
            row = first_failing_row(function, prompts, completions, columns)
            where = f" on row {row} ({text_of(completions[row])[:60]!r})" if row is not None else ""
            raise ConfigError(
                f"reward function {name} raised {type(exc).__name__}: {exc}{where}; fix the function"
            ) from None
        values = list(values) if values is not None else []
        if len(values) != len(completions):
            raise ConfigError(
                f"reward function {name} returned {len(values)} rewards for {len(completions)} completions; "
                "return one each"
            )
        for row, value in enumerate(values):
            if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(
                    f"reward function {name} returned {value!r} for row {row} ({text_of(completions[row])[:60]!r}); "
                    "return a finite number for every completion (a silent 0 would train on it)"
                )
        scores.append([float(v) for v in values])
    return scores


def weighted_rewards(
    functions: list[tuple[str, RewardFunction]],
    weights: list[float],
    rows: list[dict],
    prompt_indices: list[int],
    texts: list[str],
    prompt_column: str,
) -> tuple[list[float], list[list[float]]]:
    """Each completion's reward Σ_f w_f · r_f, and each function's scores ([function][completion]).
    Completion i answers `rows[prompt_indices[i]]`, whose prompt and other columns the functions get
    (`prompt_ids`, the tokenized prompt, is not one of them)."""
    columns = {key: [rows[i][key] for i in prompt_indices] for key in rows[0] if key != "prompt_ids"}
    prompts = columns.pop(prompt_column)
    scores = score(functions, prompts, texts, columns)
    return [sum(w * s[i] for w, s in zip(weights, scores)) for i in range(len(texts))], scores


def first_failing_row(function: RewardFunction, prompts: Sequence, completions: Sequence, columns: dict) -> int | None:
    for row in range(len(completions)):
        try:
            function(prompts=prompts[row : row + 1], completions=completions[row : row + 1],
                     **{k: v[row : row + 1] for k, v in columns.items()})  # fmt: skip
        except Exception:
            return row
    return None
