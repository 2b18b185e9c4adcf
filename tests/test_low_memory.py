"""The low-memory options (issue 17): QLoRA's 4-bit base, 8-bit AdamW, activation offloading.

bitsandbytes' 4-bit weights and 8-bit AdamW run on CPU, so these tests run the real kernels: no
quantization is mocked. Exactness is checked as for every other feature: (micro 8, accumulation 1)
against (micro 2, accumulation 4) through the recipe. QLoRA under real DDP runs in the causal-LM
recipe's one launch (tests/test_causal_lm.py).
"""

import contextlib
import functools
import importlib.util
import subprocess
import sys

import pytest
import torch
from conftest import (
    RTOL,
    error_of,
    launch_command,
    read_metrics,
    recipe_args,
    run_in_process,
    tiny_lm_args,
    write_jsonl,
)
from safetensors.torch import load_file

from ft_accum.models import loading, low_memory
from ft_accum.planner import tracing
from ft_accum.testing import make_conversations, make_tiny_chat_lm, relative_error

bitsandbytes = pytest.importorskip("bitsandbytes", reason='the [lowmem] extra: pip install -e ".[lowmem]"')
peft = pytest.importorskip("peft")


def adapter_weights(output_dir):
    return load_file(str(output_dir / "final" / "adapter_model.safetensors"))


def full_weights(output_dir):
    return load_file(str(output_dir / "final" / "model.safetensors"))


def assert_same_updates(out, reference):
    """Per-update loss and pre-clipping gradient norm within RTOL: a wrong gradient scale shows here
    even where the optimizer would hide it."""
    ours, theirs = read_metrics(out), read_metrics(reference)
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=RTOL)
        assert a["loss"] == pytest.approx(b["loss"], rel=RTOL)
        assert a["tokens_seen"] == b["tokens_seen"]


def test_qlora_accumulation_matches_the_full_batch(tmp_path, llama_64_dir, lm_data_files, capsys):
    """The 4-bit base is frozen; the fp32 LoRA adapters' gradients are what accumulates. The 4-bit
    matmuls compute in bf16, per row, so the split of the batch changes only summation order."""
    runs = {}
    for micro, accumulation in ((8, 1), (2, 4)):
        out = tmp_path / f"{micro}x{accumulation}"
        args = tiny_lm_args(
            llama_64_dir, lm_data_files, out, use_lora=True, load_in_4bit=True, learning_rate=1e-2,
            per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        )  # fmt: skip
        run_in_process("causal_lm", args)
        runs[micro] = out
    banner = capsys.readouterr().out
    assert "frozen float32/uint8" in banner, "the base was not stored in 4 bits"  # NF4 packs two weights per byte
    assert_same_updates(runs[2], runs[8])
    ours, reference = adapter_weights(runs[2]), adapter_weights(runs[8])
    assert relative_error(ours, reference) <= RTOL
    moved = max(float(w.abs().max()) for k, w in reference.items() if "lora_B" in k)
    assert moved > 1e-3, "the adapters did not train: the comparison would be empty"


def test_qlora_gradients_match_a_model_holding_the_dequantized_weights(llama_64_dir):
    """The 4-bit model's adapter gradients against an ordinary fp32 model whose linear weights are the
    NF4 values dequantized: the same function, so the same gradients, up to fp32 rounding. An eval
    pass comes first, as in the recipes: that is when bitsandbytes' CPU inference repacking used to
    cut the gradient through the frozen layers (low_memory.prepare_4bit_model)."""
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(
        llama_64_dir, quantization_config=low_memory.quantization_config("no"), device_map={"": "cpu"}
    )
    quantized = low_memory.prepare_4bit_model(quantized, "no")
    reference = AutoModelForCausalLM.from_pretrained(llama_64_dir)
    layers = dict(reference.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            layers[name].weight.data = dequantize_4bit(module.weight.data, module.weight.quant_state).float()
    grads = []
    for model in (quantized, reference):
        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # zero at init, which would leave lora_A without a gradient
                torch.nn.init.normal_(parameter, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        ids = torch.randint(3, 40, (4, 24), generator=torch.Generator().manual_seed(1))
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    assert relative_error(grads[0], grads[1]) <= 1e-4
    first_layer = [n for n in grads[0] if ".layers.0." in n and "lora_A" in n]
    assert relative_error({n: grads[0][n] for n in first_layer}, {n: grads[1][n] for n in first_layer}) <= 1e-4


def test_qlora_merge_goes_into_a_bf16_copy_of_the_base(tmp_path, llama_64_dir, lm_data_files, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    args = tiny_lm_args(
        llama_64_dir, lm_data_files, out, use_lora=True, load_in_4bit=True, merge_lora=True, learning_rate=3e-2
    )
    run_in_process("causal_lm", args)
    assert "not into its 4-bit weights" in capsys.readouterr().out
    merged = AutoModelForCausalLM.from_pretrained(out / "final_merged")
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    base = AutoModelForCausalLM.from_pretrained(llama_64_dir, dtype=torch.bfloat16)
    expected = peft.PeftModel.from_pretrained(base, out / "final").merge_and_unload()
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(merged(input_ids=ids).logits, expected(input_ids=ids).logits)
    plain = AutoModelForCausalLM.from_pretrained(llama_64_dir, dtype=torch.bfloat16)
    assert not torch.equal(plain(input_ids=ids).logits, merged(input_ids=ids).logits), "the adapter changed nothing"


# 8-bit AdamW rounds each moment to one of 256 levels per block of 256. Two runs whose gradients
# differ by summation order (~1e-7) can round an element's moments to neighbouring levels: one level
# of m and one of v, each up to about 1/127 of the step, so an element's update differs by up to
# about 2·lr/127 per update. Over 3 updates at lr 1e-3 that is 4.7e-5 for an element (2.4e-5 seen
# with bitsandbytes 0.50.2, just over one level per update); the weights' norm moves far less, so
# 1e-4 relative is the bound, 10× the fp32 one. Loss and gradient norm come before the optimizer and
# keep the fp32 bound. A wrong weighting of the micro-batches is ≥ 1e-2 relative.
ADAMW_8BIT_RTOL = 1e-4


def test_8bit_adamw_accumulation_matches_the_full_batch(tmp_path, llama_64_dir, lm_data_files, capsys):
    runs = {}
    for micro, accumulation in ((8, 1), (2, 4)):
        out = tmp_path / f"{micro}x{accumulation}"
        args = tiny_lm_args(
            llama_64_dir, lm_data_files, out, optim="adamw_8bit",
            per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        )  # fmt: skip
        run_in_process("causal_lm", args)
        runs[micro] = out
    assert "optimizer state float32/uint8" in capsys.readouterr().out, "the optimizer state is not 8-bit"
    assert_same_updates(runs[2], runs[8])
    ours, reference = full_weights(runs[2]), full_weights(runs[8])
    assert relative_error(ours, reference) <= ADAMW_8BIT_RTOL
    assert max(float((ours[k] - reference[k]).abs().max()) for k in ours) <= 3 * 2 * 1e-3 / 127


def test_stochastic_rounding_8bit_adamw_on_bf16_weights_matches_the_full_batch(
    tmp_path, llama_64_dir, lm_data_files, monkeypatch
):
    """torchao's 8-bit AdamW with stochastic rounding, on bf16 weights. bf16 weights mean bf16
    compute, whose matmuls round each output to 2^-8 differently for each batch shape, so the split
    changes the weights at about that level. Measured: 5.9e-4 relative in the weights after 3
    updates (5.3e-4 with plain AdamW on the same bf16 weights, so the rounding adds little), losses
    within 2e-6; the bounds are about 10× that. The rounding draws come from the same seeded
    generator in both runs.

    torchao wraps its per-parameter step in torch.compile; here dynamo traces it whole as usual, but
    its graph runs as traced (backend "eager") instead of through inductor, whose cold C++ compile,
    once per parameter shape, took 42 s of a 2-core CI run for the same arithmetic."""
    pytest.importorskip("torchao")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    runs = {}
    for micro, accumulation in ((8, 1), (2, 4)):
        runs[micro] = tmp_path / f"{micro}x{accumulation}"
        args = tiny_lm_args(
            llama_64_dir, lm_data_files, runs[micro], optim="adamw_torch_8bit", model_dtype="bfloat16",
            per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        )  # fmt: skip
        run_in_process("causal_lm", args)
    ours, theirs = read_metrics(runs[2]), read_metrics(runs[8])
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-2)
    assert relative_error(full_weights(runs[2]), full_weights(runs[8])) <= 6e-3
    assert {w.dtype for w in full_weights(runs[2]).values()} == {torch.bfloat16}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # nn.Linear layers, and GPT-2's Conv1D ones
def test_planner_counts_the_4bit_weights_as_bitsandbytes_stores_them(tmp_path, arch):
    """The planner's parameter bytes for a QLoRA model against the real model's tensors: NF4 data,
    the quantization state (absmax, nested absmax, code books), the bf16 embeddings and head, the
    fp32 norms and adapters."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    config = (
        LlamaConfig(
            vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128,
        )
        if arch == "llama"
        else GPT2Config(vocab_size=1024, n_embd=256, n_layer=2, n_head=4, n_positions=128)
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", quantization_config=low_memory.quantization_config("bf16"), device_map={"": "cpu"}
    )
    model = low_memory.prepare_4bit_model(model, "bf16")
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    real = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        real += tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)
        if state is not None:
            real += sum(t.numel() * t.element_size() for t in (state.absmax, state.code))
            if state.nested:
                real += sum(t.numel() * t.element_size() for t in (state.state2.absmax, state.state2.code))
    predicted = tracing.trace_step(
        config, task="causal_lm", micro_batch_size=1, seq_len=16, precision="bf16-mixed", lora_r=8, load_in_4bit=True
    ).parameters
    print(f"predicted {predicted:,.0f} bytes, real {real:,.0f}")
    assert predicted == pytest.approx(real, rel=0.02)
    # The control: counting the quantized weights in bf16 would be off by far more than the bound.
    frozen = AutoModelForCausalLM.from_config(config).requires_grad_(False)
    quantized = sum(w.numel() for w in tracing.quantized_weights(frozen))
    assert quantized * (2 - tracing.NF4_BYTES_PER_PARAMETER) > 0.3 * real


def test_planner_counts_the_8bit_adamw_state_as_bitsandbytes_stores_it():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    optimizer = low_memory.adamw_8bit(model.parameters(), 1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    real = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for k, v in state.items()
        if torch.is_tensor(v) and k != "step" and not k.startswith("qmap")  # the two code books are shared
    )
    assert {state["state1"].dtype for state in optimizer.state.values() if "state1" in state} >= {torch.uint8}
    predicted = tracing.trace_step(
        config, task="causal_lm", micro_batch_size=1, seq_len=16, optimizer="adamw_8bit"
    ).optimizer_state
    print(f"predicted {predicted:,.0f} bytes, real {real:,.0f}")
    assert predicted == pytest.approx(real, rel=0.02)
    fp32_state = 8 * sum(p.numel() for p in model.parameters())
    assert real < 0.3 * fp32_state


def counted(hooks, copied: list):
    """`hooks` with a pack hook that also records the size of each tensor it offloads."""
    pack = hooks.pack_hook

    def pack_and_count(tensor):
        if low_memory.offloads(tensor):
            copied.append(tensor.numel())
        return pack(tensor)

    hooks.pack_hook = pack_and_count
    return hooks


def test_offloaded_activations_come_back_bit_for_bit(tiny_llama_dir):
    """The hooks behind --offload_activations, on CPU with unpinned copies: every large saved tensor
    is copied out and its copy used in backward, and the gradients are the same to the bit. With
    checkpointing, what is saved (and so offloaded) is each block's input."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 40, (4, 24))
    for checkpointing in (False, True):
        grads, counts = [], []
        for offload in (False, True):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
            if checkpointing:
                loading.enable_gradient_checkpointing(model)
            model.train()
            copied = []
            hooks = counted(low_memory.offload_hooks(torch.device("cpu"), pin_memory=False), copied)
            with hooks if offload else contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            counts.append(len(copied))
        assert torch.equal(grads[0], grads[1])
        assert counts[1] > 0, "nothing was offloaded"
        if checkpointing:
            assert counts[1] >= model.config.num_hidden_layers, "the checkpointed block inputs were not offloaded"


def test_launched_processes_do_without_the_lowmem_packages_unless_the_launch_asks():
    """tests/conftest.py hides bitsandbytes and torchao from every process a test launches, as an
    install without the [lowmem] extra lacks them; `launch_command(lowmem=True)` shows them again."""
    names = ("bitsandbytes", "torchao")
    probe = "import importlib.util as u; print([u.find_spec(n) is None for n in %r])" % (names,)
    here = str([importlib.util.find_spec(n) is None for n in names])
    for lowmem, missing in ((False, "[True, True]"), (True, here)):
        _, env = launch_command("text_classification", [], lowmem=lowmem)
        result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        assert result.stdout.strip() == missing, (lowmem, result.stdout)


def test_offloading_on_a_cpu_run_is_refused_in_one_line(tmp_path, tiny_gpt2_dir, lm_data_files):
    message = error_of("causal_lm", tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path, offload_activations=True))
    assert "--offload_activations" in message and "GPU" in message and "drop the flag" in message


def test_4bit_without_lora_is_refused(tmp_path, tiny_gpt2_dir, lm_data_files):
    message = error_of("causal_lm", tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path, load_in_4bit=True))
    assert "--use_lora" in message


def test_a_missing_torchao_names_the_install_and_the_alternative(tmp_path, tiny_gpt2_dir, lm_data_files, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    message = error_of("causal_lm", tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path, optim="adamw_torch_8bit"))
    assert "torchao" in message and "--optim adamw_8bit" in message


@pytest.mark.parametrize("flags", [{"optim": "adamw_8bit"}, {"load_in_4bit": True, "use_lora": True}])
def test_a_missing_bitsandbytes_names_the_extra(tmp_path, tiny_gpt2_dir, lm_data_files, monkeypatch, flags):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes now raises ImportError
    message = error_of("causal_lm", tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path, **flags))
    assert "bitsandbytes" in message and '".[lowmem]"' in message


def test_qlora_instruction_tuning_accumulation_matches_the_full_batch(tmp_path):
    """The instruction recipe's QLoRA: assistant-token weighting over answers 20× apart in length."""
    model_dir = make_tiny_chat_lm(tmp_path / "chat-lm", width=64)
    data = {
        "train": write_jsonl(tmp_path / "train.jsonl", make_conversations(16, seed=3)),
        "validation": write_jsonl(tmp_path / "validation.jsonl", make_conversations(6, seed=4)),
    }
    runs = {}
    for micro, accumulation in ((8, 1), (2, 4)):
        runs[micro] = tmp_path / f"{micro}x{accumulation}"
        args = recipe_args(
            model_dir, data, runs[micro], use_lora=True, load_in_4bit=True, learning_rate=1e-2, max_train_steps=2,
            per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation, max_seq_length=512,
            exact_match_max_words=1, max_new_tokens=2,
        )  # fmt: skip
        run_in_process("instruction_tuning", args)
    assert relative_error(adapter_weights(runs[2]), adapter_weights(runs[8])) <= RTOL


def test_only_the_optional_kernel_notices_of_the_lowmem_libraries_are_filtered(caplog):
    import logging

    import ft_accum  # noqa: F401  (installs the filters)

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "no kernels")
        logger.warning("a warning that matters")
    assert [r.getMessage() for r in caplog.records] == ["a warning that matters"]


def test_qlora_dpo_starts_at_ln2_on_one_4bit_model_and_accumulates_exactly(tmp_path, capsys):
    """Preference tuning over an NF4 base: the reference is the 4-bit policy with its adapters off
    (first loss ln 2, no second model built or copied), and (2 × 4) = (8 × 1) on 20 pairs of very
    different lengths, whose last window is short (8 + 8 + 4)."""
    import math

    from ft_accum.testing import counting_causal_lms, make_preference_pairs, preference_args

    model_dir = make_tiny_chat_lm(tmp_path / "chat-lm", width=64)
    data = {
        "train": write_jsonl(tmp_path / "train.jsonl", make_preference_pairs(20, seed=5)),
        "validation": write_jsonl(tmp_path / "validation.jsonl", make_preference_pairs(4, seed=6)),
    }
    runs = {}
    with counting_causal_lms() as models:
        for micro, accumulation in ((8, 1), (2, 4)):
            runs[micro] = tmp_path / f"{micro}x{accumulation}"
            args = preference_args(model_dir, data, runs[micro], "dpo", True, micro, accumulation, "--load_in_4bit")
            run_in_process("preference_tuning", args)
    assert "frozen float32/uint8" in capsys.readouterr().out, "the base was not stored in 4 bits"
    assert read_metrics(runs[8])[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert models == {"built": ["LlamaForCausalLM"] * 2, "copied": []}, models
    assert_same_updates(runs[2], runs[8])
    ours, reference = adapter_weights(runs[2]), adapter_weights(runs[8])
    assert relative_error(ours, reference) <= RTOL
    assert max(float(w.abs().max()) for k, w in reference.items() if "lora_B" in k) > 1e-3, "nothing trained"
