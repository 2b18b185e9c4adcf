"""Unit tests of the pieces that keep every rank in step (issue 42): the even share of generation
prompts, the tied-weight groups FSDP must shard as one unit, a tied weight saved once, and the
one-line error of a stuck collective. Their launches are tests/test_engines.py's and test_fsdp.py's."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import T5Config, T5ForConditionalGeneration

from ft_accum.core.errors import ConfigError
from ft_accum.training import collective_timeout
from ft_accum.training.arguments import TrainingArguments
from ft_accum.training.every_rank import rank_batches
from ft_accum.training.run_outputs import without_tied_copies
from ft_accum.training.run_setup import shared_weight_modules


@given(items=st.integers(0, 40), processes=st.integers(1, 5), batch_size=st.integers(1, 9))
def test_every_rank_gets_the_same_batches_and_the_real_rows_are_each_item_once(items, processes, batch_size):
    shares = [list(rank_batches(list(range(items)), rank, processes, batch_size)) for rank in range(processes)]
    assert len({tuple(len(batch) for batch, _ in share) for share in shares}) == 1  # same calls, same sizes
    real = sorted(x for share in shares for batch, n in share for x in batch[:n])
    assert real == list(range(items))
    assert all(n <= len(batch) for share in shares for batch, n in share)


def test_a_t5s_shared_embedding_is_one_group_and_an_untied_model_has_none():
    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    model = T5ForConditionalGeneration(config)
    names = {id(m): n for n, m in model.named_modules()}
    assert [[names[id(m)] for m in g] for g in shared_weight_modules(model)] == [
        ["shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"]
    ]
    assert shared_weight_modules(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == []


def test_ties_that_share_a_module_are_one_group():
    """BERT's LM head: the output layer's weight is the embedding's, its bias the head's own."""
    embedding, head, output = torch.nn.Embedding(5, 3), torch.nn.Module(), torch.nn.Linear(3, 5)
    output.weight = embedding.weight
    head.bias = output.bias
    head.decoder = output
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
    assert [[type(m).__name__ for m in g] for g in shared_weight_modules(model)] == [["Embedding", "Module", "Linear"]]


def test_a_tied_weight_is_saved_under_its_first_name_only():
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    model["b"].weight = model["a"].weight
    gathered = {k: v.clone() for k, v in model.state_dict().items()}  # FSDP's gather: a tensor per name
    assert sorted(without_tied_copies(model, gathered)) == ["a.bias", "a.weight", "b.bias"]
    assert without_tied_copies(model, None) is None


def test_a_stuck_collective_is_one_line_with_the_phase_update_checkpoint_and_resume():
    collective_timeout.start_run(timeout_seconds=5, process_index=1, num_processes=2)
    position = collective_timeout.POSITION
    position.updates_done, position.last_checkpoint, position.resume_command = (
        6,
        "out/step_000006",
        "accelerate launch x",
    )
    timed_out = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    with pytest.raises(ConfigError) as error:
        with collective_timeout.collective_failures():
            with collective_timeout.phase("eval"):
                raise timed_out
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "a process stopped joining collective operations (after update 6, in eval): process 1 of 2"
    )
    assert "waited 5 s (--ddp_timeout)" in message and "out/step_000006; resume with: accelerate launch x" in message
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.7]:21937")
    with pytest.raises(ConfigError) as error:
        with collective_timeout.collective_failures():
            raise lost
    assert "process 1 of 2 lost its connection to the process on 10.0.0.7, which stopped" in str(error.value)
    assert "FSDP" not in str(error.value)  # a lost machine is not a skipped model call
    with pytest.raises(ValueError, match="not a collective"):  # any other error passes through unchanged
        with collective_timeout.collective_failures():
            raise ValueError("not a collective")
    with collective_timeout.phase("sample"):
        assert collective_timeout.POSITION.phase == "sample"
    assert collective_timeout.POSITION.phase == "eval"  # left where the error was raised, then restored by a block


def test_ddp_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="--ddp_timeout must be ≥ 1"):
        TrainingArguments(ddp_timeout=0)
