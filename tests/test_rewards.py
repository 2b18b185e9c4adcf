"""ft_accum/data/rewards.py: the bundled arithmetic task and its reward, and the reward functions a
run names: loaded from module:function, called, and every bad outcome a one-line error (issue 43)."""

import math

import pytest

from ft_accum.core.errors import ConfigError
from ft_accum.data.rewards import (
    arithmetic_task,
    exact_answer_reward,
    load_reward_functions,
    reward_weights,
    score,
    weighted_rewards,
)


def test_the_arithmetic_task_is_seeded_and_its_answers_are_right():
    task = arithmetic_task(50, seed=3)
    assert task.to_list() == arithmetic_task(50, seed=3).to_list() != arithmetic_task(50, seed=4).to_list()
    for row in task:
        question = row["prompt"][0]["content"]
        a, op, b = question.removeprefix("What is ").split("?")[0].split()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_the_exact_answer_reward_reads_the_last_number():
    completions = ["19", "The answer is 19.", "-3", "It is 1 9", "", [{"role": "assistant", "content": "19"}],
                   "12 + 7 = 19", "19 - 8 = 5"]  # fmt: skip
    answers = ["19", "19", "-3", "19", "19", "19", "19", "11"]
    assert exact_answer_reward(None, completions, answer=answers) == [1, 1, 1, 0, 0, 1, 1, 0]


def test_reward_functions_load_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, **kw):\n    return [len(c) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    functions = load_reward_functions("my_rewards:length, ft_accum.data.rewards:exact_answer_reward")
    assert [name for name, _ in functions] == ["my_rewards:length", "ft_accum.data.rewards:exact_answer_reward"]
    assert score(functions, ["p", "p"], ["19", "abc"], {"answer": ["19", "19"]}) == [[2.0, 3.0], [1.0, 0.0]]


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("no_such_module:f", "cannot import no_such_module"),
        ("ft_accum.data.rewards:no_such_function", "has no function no_such_function"),
        ("just_a_name", "must be module:function"),
    ],
)
def test_a_reward_function_that_is_not_there_is_one_line(spec, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_reward_functions(spec)


def test_a_raising_nan_or_none_reward_names_the_function_and_the_row():
    def fails_on_the_second(prompts, completions, **kw):
        return [1.0 / (len(c) - 3) for c in completions]  # "abc": ZeroDivisionError

    def gives(value):
        return lambda prompts, completions, **kw: [0.5, value]

    completions, prompts = ["19", "abc"], ["p", "p"]
    with pytest.raises(ConfigError, match=r"reward function f raised ZeroDivisionError: .* on row 1 \('abc'\)"):
        score([("f", fails_on_the_second)], prompts, completions, {})
    for value in (math.nan, None, math.inf):
        with pytest.raises(ConfigError, match=rf"reward function g returned {value!r} for row 1"):
            score([("g", gives(value))], prompts, completions, {})
    with pytest.raises(ConfigError, match="returned 1 rewards for 2 completions"):
        score([("h", lambda prompts, completions, **kw: [1.0])], prompts, completions, {})


def test_reward_weights_are_one_per_function():
    assert reward_weights(None, 2) == [1.0, 1.0] and reward_weights("1,0.5", 2) == [1.0, 0.5]
    with pytest.raises(ConfigError, match="2 weights for 3 reward"):
        reward_weights("1,0.5", 3)
    with pytest.raises(ConfigError, match="must be numbers"):
        reward_weights("1,x", 2)


def test_weighted_rewards_give_each_function_the_prompt_and_the_other_columns():
    rows = [
        {"prompt": "What is 1 + 1?", "answer": "2", "prompt_ids": [1, 2]},
        {"prompt": "p", "answer": "3", "prompt_ids": [3]},
    ]
    seen = {}

    def columns_of(prompts, completions, **columns):
        seen.update(prompts=prompts, **columns)
        return [0.5] * len(completions)

    functions = [("exact", exact_answer_reward), ("half", columns_of)]
    totals, scores = weighted_rewards(functions, [1.0, 2.0], rows, [0, 0, 1], ["2", "5", "3"], "prompt")
    assert scores == [[1.0, 0.0, 1.0], [0.5, 0.5, 0.5]] and totals == [2.0, 1.0, 2.0]
    assert seen == {"prompts": ["What is 1 + 1?", "What is 1 + 1?", "p"], "answer": ["2", "2", "3"]}  # no prompt_ids
