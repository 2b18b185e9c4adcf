"""Every shared training flag is honoured or refused in one line, in every recipe (docs/shared_flags.md).

No list of recipes and no per-recipe settings: each file in recipes/ runs its offline default, cut to one
layer, for one update with every flag of `ft_accum.testing.shared_flags.TRIALS` at once (a refused flag
is dropped and the rest run again, `try_shared_flags`); each flag must then show in what the run did, or
have been refused with one `error:` line. Before issue 62 the preference and GRPO recipes accepted
--offload_activations and did nothing with it, and GRPO evaluated 8 prompts per call whatever
--per_device_eval_batch_size said: this test failed on both.
"""

import dataclasses
from pathlib import Path

import pytest
from conftest import ROOT

from ft_accum.cli.check import first_layers_only, run
from ft_accum.data import offline_assets
from ft_accum.testing.shared_flags import NOT_TRIED, TRIALS, try_shared_flags
from ft_accum.training.arguments import TrainingArguments


def test_every_shared_flag_is_tried_or_says_why_not():
    shared = {f.name for f in dataclasses.fields(TrainingArguments)}
    tried = {trial.flags[0].removeprefix("--") for trial in TRIALS}
    assert tried.isdisjoint(NOT_TRIED), tried & set(NOT_TRIED)
    assert tried | set(NOT_TRIED) == shared, (shared - tried - set(NOT_TRIED), tried | set(NOT_TRIED) - shared)


def test_the_docs_table_names_every_shared_flag():
    page = (ROOT / "docs" / "shared_flags.md").read_text()
    missing = [f.name for f in dataclasses.fields(TrainingArguments) if f"`--{f.name}`" not in page]
    assert missing == [], f"docs/shared_flags.md does not list {missing}"


@pytest.mark.launch
@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.py")), ids=lambda p: p.stem)
def test_every_recipe_honours_or_refuses_each_shared_flag(recipe: Path, tmp_path, monkeypatch, chat_lm_dir):
    # The default SmolLM2 as a tiny Llama with its tokenizer and chat template (tests/test_engines.py's hook).
    monkeypatch.setattr(offline_assets, "bundled_smollm2_dir", lambda cache_dir=None: chat_lm_dir)
    with first_layers_only(1):
        report = try_shared_flags(lambda argv: run(recipe, argv), tmp_path)
    assert report.failure is None, report.failure
    assert report.ignored == [], f"{recipe.name} accepts {report.ignored} and the run shows nothing of them"
    assert len(report.honoured) + len(report.refused) == len(TRIALS)
