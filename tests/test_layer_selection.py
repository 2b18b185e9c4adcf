"""The student built from its teacher's layers (models/layer_selection.py) on a tiny Llama with the real
SmolLM2 tokenizer: which layers, the same weights, a working forward and generate, and a saved copy
that loads as a model of its own depth."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from ft_accum.core.errors import ConfigError
from ft_accum.models.layer_selection import evenly_spaced_layers, student_from_teacher


@pytest.mark.parametrize(
    "num_layers, keep, expected",
    [(30, 15, None), (4, 2, [0, 3]),
     (5, 3, [0, 2, 4]), (6, 1, [5]), (4, 4, [0, 1, 2, 3])],
)  # fmt: skip
def test_the_first_and_last_layers_are_kept_and_the_rest_spread_evenly(num_layers, keep, expected):
    kept = evenly_spaced_layers(num_layers, keep)
    assert len(kept) == keep == len(set(kept)) and kept == sorted(kept)
    assert kept[-1] == num_layers - 1 and (keep == 1 or kept[0] == 0)
    if expected is not None:
        assert kept == expected
    gaps = [b - a for a, b in zip(kept, kept[1:])]
    assert not gaps or max(gaps) - min(gaps) <= 1  # evenly spaced, to rounding


@pytest.mark.parametrize("keep", [0, 5])
def test_a_student_deeper_than_its_teacher_or_empty_is_one_line(keep):
    with pytest.raises(ConfigError, match="--student_layers must be between 1 and the teacher's 4 layers"):
        evenly_spaced_layers(4, keep)


def test_the_student_is_the_teacher_s_chosen_layers_and_runs(tmp_path, chat_lm_dir):
    teacher = AutoModelForCausalLM.from_pretrained(chat_lm_dir)
    student, kept = student_from_teacher(teacher, 1)
    assert kept == [1] and student.config.num_hidden_layers == 1 and len(student.model.layers) == 1
    assert len(teacher.model.layers) == 2  # the teacher is untouched
    for (name, ours), theirs in zip(
        student.model.layers[0].state_dict().items(), teacher.model.layers[1].state_dict().values()
    ):
        assert torch.equal(ours, theirs), name
    assert student.model.layers[0].self_attn.layer_idx == 0
    ids = torch.tensor([[1, 5, 9, 3]])
    assert student(input_ids=ids).logits.shape == teacher(input_ids=ids).logits.shape
    student.generate(ids, max_new_tokens=3, do_sample=False)  # the KV cache sees one layer
    student.save_pretrained(tmp_path / "student")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "student")
    assert reloaded.config.num_hidden_layers == 1
    torch.testing.assert_close(reloaded(input_ids=ids).logits, student(input_ids=ids).logits)
