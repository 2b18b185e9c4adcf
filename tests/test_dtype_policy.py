"""The dtype policy (issue 16): a full fine-tune of a bf16 checkpoint trains and saves fp32 master
weights, unless --model_dtype bfloat16 asks for pure bf16; the banner says which."""

import pytest
import torch
from conftest import make_tiny_lm, run_in_process, tiny_lm_args
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Llama saved in bf16, as most hub LLMs are."""
    path = make_tiny_lm("llama", tmp_path_factory.mktemp("bf16-llama"))
    AutoModelForCausalLM.from_pretrained(path).to(torch.bfloat16).save_pretrained(path)
    # The premise: transformers 5 loads it as bf16 parameters unless told otherwise.
    assert next(AutoModelForCausalLM.from_pretrained(path).parameters()).dtype == torch.bfloat16
    return path


@pytest.mark.parametrize("model_dtype, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_full_fine_tuning_of_a_bf16_checkpoint_keeps_the_chosen_master_dtype(
    tmp_path, bf16_checkpoint, lm_data_files, capsys, model_dtype, expected
):
    out = tmp_path / model_dtype
    args = tiny_lm_args(
        bf16_checkpoint, lm_data_files, out, per_device_train_batch_size=4, max_train_steps=2, checkpointing_steps=1
    )
    run_in_process("causal_lm", [*args, f"--model_dtype={model_dtype}"])

    during = load_file(out / "checkpoints" / "step_000001" / "model.safetensors")  # a snapshot mid-run
    final = load_file(out / "final" / "model.safetensors")
    assert {t.dtype for t in during.values()} == {expected}
    assert {t.dtype for t in final.values()} == {expected}
    optimizer_state = torch.load(out / "checkpoints" / "step_000001" / "optimizer.bin", weights_only=True)["state"]
    assert {v.dtype for s in optimizer_state.values() for v in s.values() if v.dim()} == {expected}
    banner = capsys.readouterr().out
    name = str(expected).removeprefix("torch.")
    assert f"dtypes              weights {name}; compute {name}; optimizer state {name}" in banner
    assert ("updates below 1/256 of a weight are lost" in banner) == (expected == torch.bfloat16)


def test_an_unknown_model_dtype_is_refused(tmp_path, bf16_checkpoint, lm_data_files):
    with pytest.raises(SystemExit, match="^error: --model_dtype must be float32 or bfloat16"):
        run_in_process("causal_lm", [*tiny_lm_args(bf16_checkpoint, lm_data_files, tmp_path), "--model_dtype=fp8"])


def test_lora_freezes_its_base_in_the_mixed_precision_dtype(
    tmp_path, bf16_checkpoint, lm_data_files, capsys, monkeypatch
):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what accelerate_configs/single_gpu_bf16.yaml sets
    args = tiny_lm_args(bf16_checkpoint, lm_data_files, tmp_path, per_device_train_batch_size=4, max_train_steps=1)
    run_in_process("causal_lm", [*args, "--use_lora", "--lora_target_modules=q_proj,v_proj"])
    banner = capsys.readouterr().out
    assert "weights float32, frozen bfloat16; compute bfloat16 (autocast); optimizer state float32" in banner


def test_lora_adapters_take_the_model_dtype(tmp_path, bf16_checkpoint, lm_data_files, capsys):
    """The adapters are the trained weights: --model_dtype bfloat16 makes them (and their AdamW state) bf16."""
    from safetensors.torch import load_file

    args = tiny_lm_args(bf16_checkpoint, lm_data_files, tmp_path, per_device_train_batch_size=4, max_train_steps=1)
    run_in_process("causal_lm", [*args, "--use_lora", "--lora_target_modules=q_proj,v_proj", "--model_dtype=bfloat16"])
    assert "weights bfloat16, frozen bfloat16" in capsys.readouterr().out
    adapter = load_file(str(tmp_path / "final" / "adapter_model.safetensors"))
    assert adapter and {w.dtype for w in adapter.values()} == {torch.bfloat16}
