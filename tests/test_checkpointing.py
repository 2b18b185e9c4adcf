import json

import pytest
import torch
from accelerate import Accelerator

from ft_accum.core.errors import ConfigError
from ft_accum.testing import reset_accelerate_state
from ft_accum.training import checkpointing


@pytest.fixture
def accelerator():
    acc = Accelerator(cpu=True)
    yield acc
    reset_accelerate_state()


def prepared(accelerator):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    return accelerator.prepare(model, optimizer)


def test_save_writes_a_complete_checkpoint_and_latest_finds_it(tmp_path, accelerator):
    prepared(accelerator)
    for step in (3, 12, 7):
        checkpointing.save_checkpoint(accelerator, tmp_path, step, {"samples_seen": step * 8})
    assert checkpointing.latest_checkpoint(tmp_path).name == "step_000012"
    assert [p.name for p in checkpointing.list_checkpoints(tmp_path)] == ["step_000003", "step_000007", "step_000012"]
    state = checkpointing.load_training_state(tmp_path / "checkpoints" / "step_000012")
    assert {k: v for k, v in state.items() if k != "manifest"} == {"step": 12, "samples_seen": 96}
    assert (tmp_path / "checkpoints" / "step_000012" / "model.safetensors").is_file()
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_crash_while_saving_leaves_no_checkpoint(tmp_path, accelerator, monkeypatch):
    prepared(accelerator)
    checkpointing.save_checkpoint(accelerator, tmp_path, 1, {})

    def crash(output_dir, **kwargs):
        (tmp_path / "checkpoints" / ".tmp-step_000002" / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(accelerator, "save_state", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save_checkpoint(accelerator, tmp_path, 2, {})
    assert not (tmp_path / "checkpoints" / "step_000002").exists()
    assert checkpointing.latest_checkpoint(tmp_path).name == "step_000001"
    assert checkpointing.resolve_resume_checkpoint("latest", tmp_path).name == "step_000001"


@pytest.mark.parametrize(
    "error, expected, not_expected",
    [
        (OSError(28, "No space left on device"), "free disk space or lower --save_total_limit", "not a full disk"),
        (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"), "free disk space", "not a full disk"),
        (RuntimeError("FSDP: expected a DTensor for 'lm_head.weight'"), "RuntimeError in ", "free disk space"),
    ],
)  # fmt: skip
def test_a_failed_save_names_the_cause_it_saw(tmp_path, accelerator, monkeypatch, error, expected, not_expected):
    """Issue 26: an FSDP state-dict failure was reported as a full disk, with 77 GB free."""
    prepared(accelerator)
    checkpointing.save_checkpoint(accelerator, tmp_path, 1, {})

    def fail(output_dir, **kwargs):
        raise error

    monkeypatch.setattr(accelerator, "save_state", fail)
    with pytest.raises(ConfigError) as info:
        checkpointing.save_checkpoint(accelerator, tmp_path, 2, {})
    message = str(info.value)
    assert expected in message and not_expected not in message, message
    assert "step_000001 with --resume_from_checkpoint latest" in message
    if not_expected == "free disk space":
        assert "expected a DTensor for 'lm_head.weight'" in message and "test_checkpointing.fail" in message


def test_a_peer_lost_in_the_save_is_a_collective_failure_not_a_failed_write(tmp_path, accelerator, monkeypatch):
    """A machine lost while the others save: the partial folder goes, and the error is the lost peer's line
    (collective_timeout.collective_failures), not "could not write checkpoint"."""
    from ft_accum.training import collective_timeout

    prepared(accelerator)
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:65174: Connection reset by peer")

    def fail(output_dir, **kwargs):
        raise lost

    monkeypatch.setattr(accelerator, "save_state", fail)
    with pytest.raises(ConfigError, match="lost its connection to") as info:
        with collective_timeout.collective_failures():
            checkpointing.save_checkpoint(accelerator, tmp_path, 1, {})
    assert "could not write checkpoint" not in str(info.value)
    assert not list((tmp_path / "checkpoints").iterdir())


def test_a_folder_without_the_state_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints" / "step_000005").mkdir(parents=True)
    assert checkpointing.latest_checkpoint(tmp_path) is None
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        checkpointing.resolve_resume_checkpoint(str(tmp_path / "checkpoints" / "step_000005"), tmp_path)


def test_resume_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="no complete checkpoint.*start without resuming"):
        checkpointing.resolve_resume_checkpoint("latest", tmp_path)
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000004" / checkpointing.STATE_FILE).write_text(json.dumps({"step": 4}))
    with pytest.raises(ConfigError, match="does not exist; pass one of: .*step_000004, or 'latest'"):
        checkpointing.resolve_resume_checkpoint(str(tmp_path / "nope"), tmp_path)


def test_names_sort_in_step_order():
    names = [checkpointing.checkpoint_name(s) for s in (2, 10, 100000)]
    assert names == sorted(names) == ["step_000002", "step_000010", "step_100000"]


def test_manifest_records_every_file(tmp_path, accelerator):
    prepared(accelerator)
    path = checkpointing.save_checkpoint(accelerator, tmp_path, 1, {})
    manifest = checkpointing.load_training_state(path)["manifest"]
    assert "model.safetensors" in manifest and "optimizer.bin" in manifest
    assert manifest["model.safetensors"]["size"] == (path / "model.safetensors").stat().st_size
    assert checkpointing.checkpoint_problem(path) is None


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_latest_skips_a_damaged_newest_checkpoint(tmp_path, accelerator, damage):
    prepared(accelerator)
    for step in (1, 2):
        checkpointing.save_checkpoint(accelerator, tmp_path, step, {})
    weights = tmp_path / "checkpoints" / "step_000002" / "model.safetensors"
    data = weights.read_bytes()
    # A truncated file (disk full) and one with a flipped byte (bit rot) of the same size.
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_000002"):
        assert checkpointing.resolve_resume_checkpoint("latest", tmp_path).name == "step_000001"
    with pytest.raises(ConfigError, match="is damaged"):
        checkpointing.resolve_resume_checkpoint(str(tmp_path / "checkpoints" / "step_000002"), tmp_path)


def test_save_total_limit_keeps_the_newest(tmp_path, accelerator):
    prepared(accelerator)
    for step in range(1, 6):
        checkpointing.save_checkpoint(accelerator, tmp_path, step, {}, save_total_limit=2)
    assert [p.name for p in checkpointing.list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]


def signature(**changes):
    base = {
        "model": "Bert:abc",
        "effective_batch_size": 32,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 4,
        "num_processes": 1,
        "seed": 42,
        "optim": "adamw_torch",
        "mixed_precision": "bf16",
    }
    return base | changes


def test_run_signature_tells_models_apart():
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 3)
    settings = {
        "effective_batch_size": 8,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "num_processes": 1,
        "seed": 0,
        "optim": "sgd",
    }
    assert (
        checkpointing.run_signature(a, **settings)["model"]
        == checkpointing.run_signature(torch.nn.Linear(4, 2), **settings)["model"]
    )
    assert checkpointing.run_signature(a, **settings)["model"] != checkpointing.run_signature(b, **settings)["model"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": "Bert:def"}, "different model"),
        ({"effective_batch_size": 64, "gradient_accumulation_steps": 8}, "effective_batch_size 32, this run has 64"),
        ({"num_processes": 2, "gradient_accumulation_steps": 2}, "num_processes 1, this run has 2"),
        ({"seed": 1}, "seed 42, this run has 1"),
        ({"optim": "sgd"}, "optim adamw_torch, this run has sgd"),
        ({"mixed_precision": "no"}, "mixed precision bf16, this launch runs no: .*resume_command.txt"),
    ],
)
def test_a_resume_that_would_change_the_run_is_refused(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        checkpointing.check_resume_signature(signature(), signature(**change), tmp_path)


def test_a_new_split_of_the_same_effective_batch_is_allowed_with_a_note(tmp_path):
    notes = checkpointing.check_resume_signature(
        signature(), signature(per_device_train_batch_size=4, gradient_accumulation_steps=8), tmp_path
    )
    assert len(notes) == 1 and "not bit-identical" in notes[0]
    assert checkpointing.check_resume_signature(signature(), signature(), tmp_path) == []
    assert checkpointing.check_resume_signature(None, signature(), tmp_path) == []


def test_non_finite_weights_are_never_checkpointed(tmp_path, accelerator):
    model, _ = prepared(accelerator)
    checkpointing.save_checkpoint(accelerator, tmp_path, 1, {})
    with torch.no_grad():
        accelerator.unwrap_model(model).weight[0, 0] = float("nan")
    with pytest.raises(ConfigError, match="parameter weight is not finite, so checkpoint step_000002 was not saved"):
        checkpointing.save_checkpoint(accelerator, tmp_path, 2, {})
    assert checkpointing.latest_checkpoint(tmp_path).name == "step_000001"


def test_output_dir_guard(tmp_path):
    from ft_accum.training.run_outputs import prepare_output_dir

    prepare_output_dir(tmp_path / "new", resume=False, overwrite=False)  # a fresh folder is created
    assert (tmp_path / "new").is_dir()
    (tmp_path / "new" / "all_results.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a finished run"):
        prepare_output_dir(tmp_path / "new", resume=False, overwrite=False)
    prepare_output_dir(tmp_path / "new", resume=True, overwrite=False)  # continuing it is allowed
    prepare_output_dir(tmp_path / "new", resume=False, overwrite=True)
    assert not (tmp_path / "new" / "all_results.json").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        prepare_output_dir(tmp_path / "file", resume=False, overwrite=False)
