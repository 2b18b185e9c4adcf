"""The template is for copying: recipes/text_classification.py turned into a new task (text-pair
classification, as NLI or paraphrase detection are) by the edits a user makes, a diff of at most 45
lines, passes `ft-accum check` (exact accumulation, an exact resume) with no test or library edited."""

import difflib

import pytest
from conftest import ROOT, make_rows, write_jsonl

from ft_accum.cli.check import main as ft_accum_check
from ft_accum.cli.check import run

pytestmark = pytest.mark.launch

# The user's edits, each (the template's text, the copy's): a second text column, read, checked and
# passed to the tokenizer as the pair; the command and output folder named after the new task.
EDITS = [
    ("recipes/text_classification.py \\\n", "recipes/text_pair_classification.py \\\n"),
    ("--config recipes/configs/text_classification.yaml", "--train_file pairs.jsonl"),
    (
        "Fine-tune a sequence classifier with exact gradient accumulation.",
        "Classify pairs of texts (entailment, paraphrase) with exact gradient accumulation.",
    ),
    (
        '    text_column: str = field(default="text", metadata={"help": "Column holding the text."})\n',
        '    text_column: str = field(default="text", metadata={"help": "Column holding the first text."})\n'
        '    text_pair_column: str = field(default="text_pair", metadata={"help": "Column holding the second."})\n',
    ),
    (
        "data_sources.check_columns(raw, text_column=task.text_column, label_column=task.label_column)",
        "data_sources.check_columns(\n"
        "        raw, text_column=task.text_column, text_pair_column=task.text_pair_column, label_column=task.label_column\n"
        "    )",
    ),
    (
        "data_sources.drop_empty_rows(raw, task.text_column, task.label_column)",
        "data_sources.drop_empty_rows(raw, task.text_column, task.text_pair_column, task.label_column)",
    ),
    (
        "data_sources.check_text_column(raw, task.text_column)\n",
        "data_sources.check_text_column(raw, task.text_column)\n"
        "    data_sources.check_text_column(raw, task.text_pair_column)\n",
    ),
    (
        "tokenizer(rows[task.text_column], truncation=True, max_length=task.max_seq_length)",
        "tokenizer(\n"
        "            rows[task.text_column], rows[task.text_pair_column], truncation=True, max_length=task.max_seq_length\n"
        "        )",
    ),
    (
        'run_setup.build_accelerator(task, args, "text_classification")',
        'run_setup.build_accelerator(task, args, "text_pair_classification")',
    ),
    ('output_dir="outputs/text_classification"', 'output_dir="outputs/text_pair_classification"'),
]


def make_pairs(n: int, seed: int) -> list[dict]:
    """Two texts of generated topic words; the label is whether both are on the same topic."""
    rows = make_rows(2 * n, seed)
    first, second = rows[:n], rows[n:][::-1]  # reversed: the topics fall together for some pairs, not all
    return [
        {"text": a["text"], "text_pair": b["text"], "label": "same" if a["label"] == b["label"] else "different"}
        for a, b in zip(first, second)
    ]


def test_a_copy_for_a_new_task_is_a_short_diff_and_keeps_the_contract(tmp_path, tiny_model_dir, capsys, monkeypatch):
    # From a shell that exports bf16 (a GPU user's): the check still runs in fp32, whose bounds it holds.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    template = (ROOT / "recipes" / "text_classification.py").read_text()
    copy = template
    for old, new in EDITS:
        assert copy.count(old) == 1, old
        copy = copy.replace(old, new)
    changed = [
        line
        for line in difflib.unified_diff(template.splitlines(), copy.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert len(changed) <= 45, "\n".join(changed)
    recipe = tmp_path / "text_pair_classification.py"
    recipe.write_text(copy)

    train = write_jsonl(tmp_path / "pairs.jsonl", make_pairs(24, seed=3))
    validation = write_jsonl(tmp_path / "validation.jsonl", make_pairs(6, seed=4))
    flags = [f"--model_name_or_path={tiny_model_dir}", f"--train_file={train}", f"--validation_file={validation}",
             "--max_seq_length=48"]  # fmt: skip
    capsys.readouterr()
    code = ft_accum_check([str(recipe), *flags, "--skip_fsdp"])
    out = capsys.readouterr().out
    table = out[out.index(f"ft-accum check {recipe}") :]
    assert code == 0 and "6 of 6 passed" in table and "FAIL" not in table, table

    # The copy reads its new column: rows without it are refused in one line that names the flag.
    single = write_jsonl(tmp_path / "single.jsonl", make_rows(8, seed=5))
    exit_ = run(recipe, [*flags, f"--train_file={single}", f"--output_dir={tmp_path / 'out'}"])
    assert exit_ is not None and "--text_pair_column" in str(exit_.code), exit_
