"""The memory planner: exact accounting, linearity, checkpointing, fake vs real tensors, the CLI, bad input."""

import json
from unittest import mock

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from ft_accum.core.errors import ConfigError
from ft_accum.models.layer_selection import student_config
from ft_accum.planner import configs, launch_line, task_specs, throughput, tracing
from ft_accum.planner import memory_planner as mp
from ft_accum.testing import ROOT


def tiny_gpt2(layers=2):
    return GPT2Config(
        vocab_size=512, n_positions=256, n_embd=64, n_layer=layers, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )


def tiny_llama(layers=2):
    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


@pytest.mark.parametrize(
    "name, task, published_millions",
    [
        ("gpt2-124m", "causal_lm", 124.4),
        ("bert-base-uncased", "text_classification", 109.5),
        ("t5-base", "seq2seq", 222.9),
        ("qwen2.5-0.5b", "causal_lm", 494.0),
        ("qwen2.5-1.5b", "causal_lm", 1543.7),
        ("llama-3.1-8b", "causal_lm", 8030.3),
        ("smollm2-135m", "causal_lm", 134.5),
        ("smolvlm-instruct", "vision_language", 2246.3),  # 2.25B on its model card
        ("qwen2.5-vl-3b", "vision_language", 3754.6),  # 3,754,622,976 in its safetensors index
    ],
)
def test_shipped_configs_have_the_published_sizes(name, task, published_millions):
    FakeTensorMode, _ = tracing.torch_internals()
    with FakeTensorMode():
        model = task_specs.build_model(configs.load_model_config(name), task)
        count = sum(p.numel() for p in model.parameters()) / 1e6
    assert count == pytest.approx(published_millions, rel=0.005)


@pytest.mark.parametrize("config_fn", [tiny_gpt2, tiny_llama])
def test_parameter_gradient_and_adam_state_bytes_equal_the_analytic_count(config_fn):
    config = config_fn()
    seen = {}
    tracing.trace_phases(config, task="causal_lm", micro_batch_size=4, seq_len=64, accounting=seen)
    with torch.device("meta"):
        model = task_specs.build_model(config, "causal_lm")
    unique = {id(p): p for p in model.parameters()}  # parameters() yields tied weights once
    numel = sum(p.numel() for p in unique.values())
    assert seen["parameters"] == 4 * numel + sum(b.numel() * b.element_size() for b in model.buffers())
    assert seen["gradients"] == 4 * numel
    assert seen["optimizer_state"] == 2 * 4 * numel + 4 * len(
        unique
    )  # exp_avg, exp_avg_sq, and a float32 step per tensor
    # After backward every activation is freed: what is alive is weights, gradients, state, and the
    # batch tensors the model touched (input_ids, maybe attention_mask: 4 × 64 int64 each).
    extra = seen["live"] - (seen["parameters"] + seen["gradients"] + seen["optimizer_state"])
    assert 0 <= extra <= 2 * 4 * 64 * 8, extra


def test_activation_memory_grows_linearly_in_the_micro_batch():
    traced = tracing.trace_micro_batches(tiny_llama(), [2, 4, 8, 16], task="causal_lm", seq_len=128)
    activations = {m: backward.activations_gradients_temporaries for m, (backward, _) in traced.items()}
    steps = [
        activations[4] - activations[2],
        (activations[8] - activations[4]) / 2,
        (activations[16] - activations[8]) / 4,
    ]
    # 3%: the chunked loss's last chunk is partly full, so its temporaries step rather than grow smoothly.
    assert max(steps) / min(steps) < 1.03, steps


def test_checkpointing_keeps_one_hidden_state_per_layer():
    """Without checkpointing each extra layer keeps all its activations (A bytes); with it, only its
    input hidden state, h = m·T·H·4 bytes. So going from 3 to 6 layers adds 3·A without and 3·h
    with checkpointing (within 25%: position tensors and the recompute's own peak move it a little)."""
    m, seq_len, hidden = 8, 128, 64
    settings = {"task": "causal_lm", "micro_batch_size": m, "seq_len": seq_len}

    def activations(layers, checkpointing):
        backward, _ = tracing.trace_phases(tiny_llama(layers), gradient_checkpointing=checkpointing, **settings)
        return backward.activations_gradients_temporaries

    h = m * seq_len * hidden * 4
    off_per_layer = (activations(6, False) - activations(3, False)) / 3
    on_per_layer = (activations(6, True) - activations(3, True)) / 3
    assert on_per_layer == pytest.approx(h, rel=0.25), (on_per_layer, h)
    assert off_per_layer > 8 * on_per_layer, (off_per_layer, on_per_layer)


def test_fake_trace_matches_memtracker_on_real_cpu_tensors():
    from torch.distributed._tools.mem_tracker import MemTracker

    config, m, seq_len = tiny_gpt2(), 4, 64
    fake = tracing.trace_step(config, task="causal_lm", micro_batch_size=m, seq_len=seq_len).peak
    real = tracing.trace_step(config, task="causal_lm", micro_batch_size=m, seq_len=seq_len, real_tensors=True).peak

    # The same step, tracked by torch's own MemTracker: the recipe's loss, fused AdamW, fused attention.
    torch.manual_seed(0)
    model = task_specs.build_model(config, "causal_lm")
    opt = tracing.build_optimizer("adamw", list(model.parameters()))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    batch = task_specs.example_batch(config, "causal_lm", m, seq_len)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker, mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", tracing.fused_attention):
        task_specs.recipe_step("causal_lm", None, "chunked")(model, batch, None).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    memtracker = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    # CPU kernels can pick another algorithm for real tensors than for fake ones (1.8% here).
    assert fake == pytest.approx(real, rel=0.05)
    assert fake == pytest.approx(memtracker, rel=0.05)


def test_interpolated_micro_batches_stay_close_to_direct_traces():
    config = tiny_llama(4)
    settings = {"task": "causal_lm", "seq_len": 128}
    predicted = mp.predict_micro_batches(config, [1, 2, 3, 4, 6, 8, 12, 24], **settings)
    for m in (3, 6, 12):
        direct = tracing.trace_step(config, micro_batch_size=m, **settings).peak
        assert predicted[m].peak == pytest.approx(direct, rel=0.03)
        assert predicted[m].peak >= direct * 0.999, "interpolation should err on the safe (high) side"


def test_plan_recommends_the_fastest_split_that_fits(tmp_path):
    config_file = tmp_path / "config.json"
    config_file.write_text(tiny_gpt2().to_json_string())
    big = mp.plan(str(config_file), task="causal_lm", seq_len=128, effective_batch_size=16, gpu_memory_gib=80)
    assert big["recommended"]["per_device_train_batch_size"] == 16 and not big["recommended"]["gradient_checkpointing"]
    # A card where micro-batch 4 without checkpointing just fits, and 16 does not.
    peak_4 = next(
        r["peak_gib"]
        for r in big["candidates"]
        if r["per_device_train_batch_size"] == 4 and not r["gradient_checkpointing"]
    )
    small = mp.plan(
        str(config_file),
        task="causal_lm",
        seq_len=128,
        effective_batch_size=16,
        gpu_memory_gib=peak_4 * mp.FRAGMENTATION + mp.CUDA_OVERHEAD_GIB + 1e-6,
    )
    best = small["recommended"]
    assert best is not None and best["fits"] and best["per_device_train_batch_size"] < 16
    assert best["per_device_train_batch_size"] * best["gradient_accumulation_steps"] == 16
    faster_fitting = [
        r for r in small["candidates"] if r["fits"] and r["relative_throughput"] > best["relative_throughput"]
    ]
    assert not faster_fitting


def test_plan_cli_offline_with_a_config_file_and_json(tmp_path, capsys):
    """`ft-accum plan`'s main, in this process (tests/test_sweep.py starts the same CLI as a process)."""
    from ft_accum.cli.main import main as cli_main

    config_file = tmp_path / "config.json"
    config_file.write_text(tiny_gpt2().to_json_string())
    flags = ["plan", "--config", str(config_file), "--seq_len", "64", "--effective_batch_size", "8",
             "--gpu_memory", "1GiB"]  # fmt: skip
    capsys.readouterr()
    assert cli_main(flags) in (0, None)
    table = capsys.readouterr().out
    assert "recommended: --per_device_train_batch_size 8 --gradient_accumulation_steps 1" in table
    assert "nothing fits" not in table
    assert cli_main([*flags, "--json"]) in (0, None)
    result = json.loads(capsys.readouterr().out)
    assert {r["per_device_train_batch_size"] for r in result["candidates"]} == {1, 2, 4, 8}
    assert result["recommended"]["per_device_train_batch_size"] == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model": "no-such-org/no-such-model"}, "pass --config path/to/config.json"),
        ({"gpu_memory_gib": 0.1}, "the weights and optimizer state alone need"),
        ({"effective_batch_size": 10, "num_processes": 3}, "does not split over 3 process(es)"),
        ({"task": "seq2seq"}, "has no seq2seq head"),
        ({"pcie_gbps": 0.0}, "--pcie_gbps must be a positive number"),
        ({"gpu_tflops": float("nan")}, "--gpu_tflops must be a positive number"),
        ({"task": "vision_language"}, "the planner lays out images for idefics3"),
    ],
)
def test_plan_bad_input(overrides, message, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config_file = tmp_path / "config.json"
    config_file.write_text(tiny_gpt2().to_json_string())
    settings = {
        "model": str(config_file),
        "task": "causal_lm",
        "seq_len": 64,
        "effective_batch_size": 8,
        "gpu_memory_gib": 12,
    } | overrides
    with pytest.raises(ConfigError) as error:
        mp.plan(settings.pop("model"), **settings)
    assert message in str(error.value)


def test_gpu_memory_parsing():
    assert mp.parse_memory("12GiB") == 12 and mp.parse_memory("11.5 GB") == 11.5 and mp.parse_memory("24") == 24
    with pytest.raises(ConfigError, match="is not a size"):
        mp.parse_memory("twelve")


def test_fused_attention_traces_t5s_learned_position_bias_and_keeps_less_than_math():
    """T5 passes its relative position bias to SDPA as a mask that needs a gradient; the fused
    stand-in must trace it (CUDA's memory-efficient kernel returns that gradient) and keep no scores."""
    from transformers import T5Config

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    settings = {"task": "seq2seq", "micro_batch_size": 2, "seq_len": 128}
    fused = tracing.trace_phases(config, attention="fused", **settings)[0].activations_gradients_temporaries
    math = tracing.trace_phases(config, attention="math", **settings)[0].activations_gradients_temporaries
    scores = 2 * 4 * 128 * 128 * 4  # one layer's T × T scores, fp32
    assert fused < math - scores, (fused, math)


def test_4bit_base_counts_nf4_bytes_for_the_frozen_linear_layers_only():
    """QLoRA (issue 17): every frozen nn.Linear but the output layer in NF4 with double quantization,
    embeddings and head in bf16; the largest dequantized weight joins the temporaries."""
    config = tiny_llama()
    settings = {"task": "causal_lm", "micro_batch_size": 2, "seq_len": 64, "precision": "bf16", "lora_r": 4}
    bf16 = tracing.trace_phases(config, **settings)[0]
    nf4 = tracing.trace_phases(config, load_in_4bit=True, **settings)[0]
    model = task_specs.build_model(config, "causal_lm", torch.bfloat16)
    linear = [m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear and m is not model.lm_head]
    saving = sum(n * (2 - tracing.NF4_BYTES_PER_PARAMETER) for n in linear)
    assert nf4.parameters == pytest.approx(bf16.parameters - saving)
    assert nf4.activations_gradients_temporaries == pytest.approx(
        bf16.activations_gradients_temporaries + 2 * max(linear)
    )
    assert tracing.NF4_BYTES_PER_PARAMETER == pytest.approx(0.516, abs=1e-3)
    with pytest.raises(ConfigError, match="only LoRA adapters can train"):
        tracing.trace_step(config, task="causal_lm", micro_batch_size=1, seq_len=8, load_in_4bit=True)


def test_offloaded_activations_leave_the_gpu_peak_and_are_reported_as_host_bytes():
    config, settings = tiny_llama(4), {"task": "causal_lm", "micro_batch_size": 8, "seq_len": 128}
    kept = tracing.trace_phases(config, **settings)[0]
    offloaded = tracing.trace_phases(config, offload_activations=True, **settings)[0]
    saved = kept.activations_gradients_temporaries - offloaded.activations_gradients_temporaries
    assert saved > 0.5 * kept.activations_gradients_temporaries, (saved, kept)
    assert offloaded.host_offloaded >= saved and kept.host_offloaded == 0


def test_low_bit_adamw_states_are_counted_per_parameter():
    config, settings = tiny_llama(), {"task": "causal_lm", "micro_batch_size": 1, "seq_len": 16}
    sizes = [p.numel() for p in task_specs.build_model(config, "causal_lm").parameters()]
    assert min(sizes) < tracing.LOW_BIT_MIN_ELEMENTS <= max(sizes)  # both kinds of tensor are present
    for name, per_parameter in (("adamw_8bit", 2 * (1 + 4 / 256)), ("adamw_4bit", 2 * (0.5 + 4 / 128))):
        state = tracing.trace_phases(config, optimizer=name, **settings)[0].optimizer_state
        # Tensors under 4,096 elements keep fp32 states, as bitsandbytes and torchao do.
        expected = sum(n * per_parameter if n >= tracing.LOW_BIT_MIN_ELEMENTS else 8 * n for n in sizes)
        assert state == pytest.approx(expected), name


@pytest.mark.launch  # three traces of an 8B and a 1.5B config: ~20 s on one core
def test_the_12_gib_tables_qlora_8b_and_low_memory_1_5b_rows_are_what_the_planner_predicts_now():
    """The README's 12 GB table (benchmarks/results/plan_12gb.json) says QLoRA of an 8B model and
    full fine-tuning of a 1.5B one (bf16 weights, 8-bit AdamW) fit: their rows are traced again, as
    `plan` does (the 8B's micro-batch of 4 lies between the traced 2 and 8), and must fit and
    match. How `plan` picks a row, and the flags it prints, are tested above on small models."""
    table = json.loads((ROOT / "benchmarks" / "results" / "plan_12gb.json").read_text())
    cells = {cell["cell"]: cell for cell in table["cells"]}
    for name, traced_around in (
        ("llama-3.1-8b causal_lm 1024 qlora", [2, 8]),
        ("qwen2.5-1.5b causal_lm 1024 full-8bit", []),
    ):
        cell = cells[name]
        micro = cell["per_device_train_batch_size"]
        predicted = mp.predict_micro_batches(
            configs.load_model_config(cell["model"]), sorted({micro, *traced_around}), task=cell["task"],
            seq_len=cell["seq_len"], precision=cell["precision"], optimizer=cell["optimizer"],
            lora_r=cell.get("lora_r"), load_in_4bit=cell.get("load_in_4bit", False),
            gradient_checkpointing=cell["gradient_checkpointing"],
        )[micro]  # fmt: skip
        assert predicted.peak / tracing.GIB == pytest.approx(cell["predicted_gib"], rel=1e-3), (
            f"{name}: the planner now predicts {predicted.peak / tracing.GIB:.2f} GiB; regenerate the table "
            "with benchmarks/plan_12gb_table.py"
        )
        assert mp.fits(predicted.peak, table["gpu_memory_gib"] * tracing.GIB), name


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"precision": "bf16", "optimizer": "adamw_8bit"}, ["--model_dtype=bfloat16", "--optim=adamw_torch_8bit"]),
        ({"precision": "bf16-mixed", "optimizer": "adamw_8bit"}, ["--optim=adamw_8bit"]),
        ({"precision": "bf16", "lora_r": 16, "load_in_4bit": True}, ["--use_lora --lora_r=16", "--load_in_4bit"]),
        ({"precision": "bf16-mixed", "offload_activations": True}, ["--offload_activations"]),
    ],
)
def test_the_recommendation_is_a_whole_run_whose_flags_the_recipe_accepts(settings, expected):
    """The launch line carries every low-memory choice the plan assumed, and causal_lm parses each flag."""
    from ft_accum.testing import load_recipe
    from ft_accum.training.arguments import parse_args

    recommended = {
        "per_device_train_batch_size": 4,
        "gradient_checkpointing": True,
        "offload_activations": settings.get("offload_activations", False),  # the plan allows it, a split uses it
    }
    result = {
        "task": "causal_lm", "seq_len": 1024, "effective_batch_size": 32, "num_processes": 1, "optimizer": "adamw",
        "lora_r": None, "recommended": recommended, **settings,
    }  # fmt: skip
    line = launch_line.launch_line(result)
    assert line.startswith(
        "accelerate launch --config_file accelerate_configs/single_gpu_bf16.yaml recipes/causal_lm.py"
    )
    assert all(flag in line for flag in expected)
    flags = line.split("recipes/causal_lm.py ")[1].split()
    task, args = parse_args(load_recipe("causal_lm").TaskArguments, flags)
    assert (args.per_device_train_batch_size, args.effective_batch_size, task.block_size) == (4, 32, 1024)
    assert args.gradient_checkpointing and args.model_dtype == (
        "bfloat16" if "--model_dtype=bfloat16" in line else "float32"
    )
    assert task.load_in_4bit == settings.get("load_in_4bit", False) and args.offload_activations == settings.get(
        "offload_activations", False
    )


def test_a_checkpointed_trace_leaves_the_callers_config_as_it_was():
    """Checkpointing sets use_cache=False on the model's config; a later trace must not inherit it."""
    config, settings = tiny_llama(), {"task": "causal_lm", "micro_batch_size": 4, "seq_len": 64}
    before = tracing.trace_phases(config, offload_activations=True, **settings)
    tracing.trace_phases(config, gradient_checkpointing=True, **settings)
    assert config.use_cache is True
    assert tracing.trace_phases(config, offload_activations=True, **settings) == before


def test_offloading_copies_are_priced_against_compute():
    # 4 × 512 tokens: utilisation 2048 / (2048 + 2048) = 0.5, so compute = 2048 × 6e9 / (12e12 × 0.5) = 2.048 s;
    # 10 GB to host and back at 20 GB/s = 1 s.
    plain = throughput.relative_throughput(4, 512, False)
    priced = throughput.relative_throughput(
        4, 512, False, offloaded_bytes=10e9, flops_per_token=6e9, gpu_tflops=12, pcie_gbps=20
    )
    assert plain == 0.5 and priced == pytest.approx(0.5 * 2.048 / 3.048)
    # Recomputation is one more forward: a third of 6N in full fine-tuning, half of 4N under LoRA.
    assert throughput.relative_throughput(4, 512, True) == 0.5 * 3 / 4
    assert throughput.relative_throughput(4, 512, True, trains_base_weights=False) == pytest.approx(0.5 * 2 / 3)
    # With checkpointing the compute takes 4/3 as long, so the same copies cost a smaller share.
    checkpointed = throughput.relative_throughput(
        4, 512, True, offloaded_bytes=10e9, flops_per_token=6e9, gpu_tflops=12, pcie_gbps=20
    )
    assert checkpointed == pytest.approx(0.375 * 2.048 * 4 / 3 / (2.048 * 4 / 3 + 1))


@pytest.mark.parametrize("tied", [False, True])
def test_training_flops_are_6n_per_token_and_4n_with_a_frozen_base(tied):
    config = tiny_llama()
    config.tie_word_embeddings = tied
    model = task_specs.build_model(config, "causal_lm")
    total = sum(p.numel() for p in model.parameters())
    # The input embedding is a lookup, not a matmul, unless the output layer shares it.
    matmul = total if tied else total - config.vocab_size * config.hidden_size
    assert throughput.training_flops_per_token(config, "causal_lm", trains_base_weights=True) == 6 * matmul
    assert throughput.training_flops_per_token(config, "causal_lm", trains_base_weights=False) == 4 * matmul


@pytest.mark.launch
def test_the_plan_offloads_only_where_a_split_does_not_fit_without_it_and_the_copies_pay():
    config, settings = tiny_llama(2), {"task": "causal_lm", "seq_len": 256, "effective_batch_size": 8}
    kept = mp.plan(config, gpu_memory_gib=1000, **settings)["candidates"]
    peak_of = {(r["per_device_train_batch_size"], r["gradient_checkpointing"]): r["peak_gib"] for r in kept}
    card = peak_of[(2, False)] * mp.FRAGMENTATION + mp.CUDA_OVERHEAD_GIB + 1e-6  # no-ckpt fits up to micro 2

    def planned(pcie_gbps):
        return mp.plan(config, gpu_memory_gib=card, offload_activations=True, pcie_gbps=pcie_gbps, **settings)

    free_copies, slow_copies = planned(1e12), planned(1e-3)
    rows = free_copies["candidates"]
    offloaded = {
        (r["per_device_train_batch_size"], r["gradient_checkpointing"]) for r in rows if r["offload_activations"]
    }
    not_fitting = {(r["per_device_train_batch_size"], r["gradient_checkpointing"]) for r in rows
                   if not r["offload_activations"] and not r["fits"]}  # fmt: skip
    assert offloaded == not_fitting and (4, False) in offloaded
    assert any(r["fits"] for r in rows if r["offload_activations"]), "offloading made nothing fit: retune the test"

    best = free_copies["recommended"]
    assert best["offload_activations"] and not best["gradient_checkpointing"], best
    assert best["offload_slowdown"] == pytest.approx(0, abs=1e-6) and "--offload_activations" in free_copies["launch"]
    best = slow_copies["recommended"]
    assert not best["offload_activations"] and "--offload_activations" not in slow_copies["launch"], best

    from ft_accum.cli.main import format_plan

    chosen, declined = (format_plan({**r, "seconds": 0.0}) for r in (free_copies, slow_copies))
    assert "\noffloading:  " in chosen and "predicted 0% slower" in chosen
    assert "\noffloading:  " not in declined and "tried only for the splits that do not fit" in declined
    assert "nothing fits" not in chosen + declined


def test_a_measured_offloading_slowdown_gives_back_the_bandwidth_of_the_copy_model():
    """implied_copy_gbps inverts relative_throughput's copy term: feed it the speeds the model predicts."""
    flops, gbps, host = 6 * 124e6, 25.0, 3e9
    plain = throughput.relative_throughput(8, 1024, False)
    offloaded = throughput.relative_throughput(
        8, 1024, False, offloaded_bytes=host, flops_per_token=flops, pcie_gbps=gbps
    )
    # relative speeds → samples per second on the assumed card: u × TFLOP/s / (6N × tokens per sample)
    samples_per_second = plain * throughput.ASSUMED_GPU_TFLOPS * 1e12 / (flops * 1024)
    assert throughput.implied_copy_gbps(
        host, 8, samples_per_second, samples_per_second * offloaded / plain
    ) == pytest.approx(gbps)
    assert (
        throughput.implied_copy_gbps(host, 8, 10.0, 10.0) is None
        and throughput.implied_copy_gbps(host, 8, 10.0, 11.0) is None
    )


def test_preference_plans_two_sequences_per_pair_and_the_reference_the_run_keeps():
    """--task preference (recipes/preference_tuning.py's own `forward_pairs`): m pairs are 2m sequences; full DPO adds a
    frozen copy, exactly the model's weight bytes, which --precompute_ref_log_probs removes; under
    LoRA the reference is the same model (no bytes more in weights); the fake trace of each runs
    for real on CPU tensors too (within 5%)."""
    config, m, seq_len = tiny_llama(), 2, 64
    traced = lambda task, micro, **settings: tracing.trace_micro_batches(  # noqa: E731
        config, [micro], task=task, seq_len=seq_len, **settings
    )[micro][0]
    precomputed = traced("preference", m, precompute_ref_log_probs=True)
    causal = traced("causal_lm", 2 * m)  # no reference: the policy's weights and state only, as for 2m sequences
    assert (precomputed.parameters, precomputed.optimizer_state) == (causal.parameters, causal.optimizer_state)
    assert precomputed == traced("preference", m, preference_loss="orpo")
    copy = traced("preference", m)
    model = task_specs.build_model(config, "causal_lm")
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # rotary too
    assert copy.parameters - precomputed.parameters == weights
    assert copy.optimizer_state == precomputed.optimizer_state
    lora, lora_alone = traced("preference", m, lora_r=4), traced("preference", m, lora_r=4, preference_loss="simpo")
    assert lora.parameters == lora_alone.parameters and lora.peak >= lora_alone.peak
    for settings in ({}, {"lora_r": 4}):
        real = traced("preference", m, real_tensors=True, **settings)
        assert traced("preference", m, **settings).peak == pytest.approx(real.peak, rel=0.05), settings


def test_a_preference_plan_is_a_run_of_the_preference_recipe():
    from ft_accum.testing import load_recipe
    from ft_accum.training.arguments import parse_args

    result = mp.plan(tiny_llama(), task="preference", seq_len=64, effective_batch_size=8, gpu_memory_gib=12,
                     precision="fp32", precompute_ref_log_probs=True)  # fmt: skip
    launch = result["launch"]
    assert "recipes/preference_tuning.py" in launch and "--max_seq_length 64" in launch, launch
    assert "--precompute_ref_log_probs" in launch and "--effective_batch_size 8" in launch
    flags = launch.split("recipes/preference_tuning.py ")[1].split()
    _, args = parse_args(load_recipe("preference_tuning").TaskArguments, flags)
    assert args.effective_batch_size == 8
    with pytest.raises(ConfigError, match="--loss must be one of dpo, simpo, orpo"):
        mp.plan(tiny_llama(), task="preference", seq_len=64, effective_batch_size=8, gpu_memory_gib=12,
                preference_loss="kto")  # fmt: skip
    # Another task's setting is refused in one line naming its task, never ignored.
    with pytest.raises(ConfigError, match=r"--student_layers \(--task distillation\), --image_size \(--task "
                       r"vision_language\): not a setting of --task preference"):  # fmt: skip
        mp.plan(tiny_llama(), task="preference", seq_len=64, effective_batch_size=8, gpu_memory_gib=12,
                image_size=448, student_layers=2)  # fmt: skip


def test_a_grpo_plan_scores_only_the_completion_and_is_a_run_of_the_grpo_recipe():
    """--task grpo (recipes/grpo.py): a micro-batch of m completions builds logits for the last
    --completion_length tokens only (the recipe's own completion_log_probs), so it peaks below the
    causal LM's step on the same tokens, and the fake trace runs for real on CPU tensors (within 5%)."""
    from ft_accum.testing import load_recipe
    from ft_accum.training.arguments import parse_args

    config, m, seq_len = tiny_llama(), 4, 96
    traced = lambda task, **settings: tracing.trace_micro_batches(  # noqa: E731
        config, [m], task=task, seq_len=seq_len, loss_path="logits", **settings
    )[m][0]
    grpo, whole = traced("grpo", completion_length=16), traced("grpo", completion_length=seq_len - 1)
    assert grpo.activations_gradients_temporaries < whole.activations_gradients_temporaries
    assert grpo.parameters == whole.parameters == traced("causal_lm").parameters
    real = traced("grpo", completion_length=16, real_tensors=True)
    assert grpo.peak == pytest.approx(real.peak, rel=0.05)

    result = mp.plan(tiny_llama(), task="grpo", seq_len=96, completion_length=64, effective_batch_size=16,
                     gpu_memory_gib=12, precision="fp32", lora_r=8)  # fmt: skip
    launch = result["launch"]
    assert "recipes/grpo.py" in launch and "--max_completion_length 64" in launch, launch
    task, args = parse_args(load_recipe("grpo").TaskArguments, launch.split("recipes/grpo.py ")[1].split())
    assert args.effective_batch_size == 16 and task.use_lora and task.max_completion_length == 64


@pytest.mark.parametrize(
    "precision, mixed_precision", [("bf16-mixed", "bf16"), ("fp16-mixed", "fp16"), ("fp32", "no")]
)
def test_a_lora_plan_counts_the_base_in_the_dtype_the_recipes_load_it_in(precision, mixed_precision):
    """Under mixed precision the recipes cast a base that LoRA freezes to the compute dtype
    (loading.cast_and_compile, frozen_base) and peft adds fp32 adapters: the plan's parameter bytes
    are those of the model the recipe builds, on real CPU tensors."""
    from ft_accum.models.loading import cast_and_compile
    from ft_accum.models.lora import LoraSettings, apply_lora

    config = tiny_llama()
    traced = tracing.trace_phases(
        config, task="causal_lm", micro_batch_size=1, seq_len=8, precision=precision, lora_r=4
    )
    torch.manual_seed(0)
    model = cast_and_compile(
        task_specs.build_model(config, "causal_lm"), "float32", False, mixed_precision, frozen_base=True
    )
    model = apply_lora(
        model, LoraSettings(r=4, alpha=8, dropout=0.0, target_modules="all-linear"), gradient_checkpointing=False
    )
    loaded = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert traced[0].parameters == pytest.approx(loaded, rel=1e-3)  # the rotary buffer: cast by .to(), built fp32


def test_the_plan_traces_the_recipes_own_step(tmp_path):
    """The planner runs the recipe file's `training_step`, not a copy of it: a copied recipe whose step
    keeps a second forward's activations alive for the backward gets a larger plan, with the planner
    untouched, and its own file named by `recipe=`."""
    source = (ROOT / "recipes" / "text_classification.py").read_text()
    step = '    return F.cross_entropy(logits, batch["labels"], reduction="sum", label_smoothing=label_smoothing)\n'
    assert step in source
    twice = step.replace(
        "return ", 'again = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()\n    return '
    )
    twice = twice.replace("label_smoothing)", "label_smoothing) + 0 * again.sum()")
    copy = tmp_path / "my_classifier.py"
    copy.write_text(source.replace(step, twice))
    config = configs.load_model_config(str(ROOT / "ft_accum" / "planner" / "model_configs" / "bert-base-uncased.json"))
    settings = {"task": "text_classification", "micro_batch_size": 16, "seq_len": 128}
    shipped = tracing.trace_phases(config, **settings)[0].activations_gradients_temporaries
    copied = tracing.trace_phases(config, recipe=copy, **settings)[0].activations_gradients_temporaries
    # A second forward whose graph the backward needs holds a second set of activations: ~2×.
    assert 1.7 < copied / shipped < 2.3, (copied, shipped)


def test_a_distillation_plan_holds_the_teacher_trains_the_student_and_chunks_below_the_full_logits():
    """--task distillation (recipes/distillation.py): the model is the teacher; its student of half its
    layers alone has gradients and AdamW state, the frozen teacher only adds its weights. On a 16k
    vocabulary (4 × 96 positions: 6.3M logits a model, two chunks), the chunked loss peaks below the
    loss from both full logits, measured on real CPU tensors, and each fake trace is within 5% of its
    real run. The recommendation is a run the recipe parses, --student_layers included."""
    from ft_accum.testing import load_recipe
    from ft_accum.training.arguments import parse_args

    config, m, seq_len = tiny_llama(layers=4), 4, 96
    config.vocab_size = 16384
    traced = lambda **settings: tracing.trace_micro_batches(  # noqa: E731
        config, [m], task="distillation", seq_len=seq_len, precision="fp32", **settings
    )[m][0]
    chunked, full = traced(), traced(loss_path="logits")
    student, teacher = (task_specs.build_model(c, "causal_lm") for c in (student_config(config, None), config))
    nbytes = lambda model: sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # noqa: E731
    assert chunked.parameters == nbytes(student) + nbytes(teacher)
    moments = 2 * sum(p.numel() * 4 for p in student.parameters())
    assert chunked.optimizer_state == moments + 4 * len(list(student.parameters()))  # and a step count per tensor
    real_chunked, real_full = traced(real_tensors=True), traced(loss_path="logits", real_tensors=True)
    assert real_chunked.peak < real_full.peak - 2 * 4 * m * seq_len * config.vocab_size  # two fp32 logits fewer
    assert chunked.peak == pytest.approx(real_chunked.peak, rel=0.05)
    assert full.peak == pytest.approx(real_full.peak, rel=0.05)

    result = mp.plan(config, task="distillation", seq_len=seq_len, effective_batch_size=16, gpu_memory_gib=12,
                     precision="fp32", student_layers=3)  # fmt: skip
    launch = result["launch"]
    assert "recipes/distillation.py" in launch and "--max_seq_length 96" in launch, launch
    task, args = parse_args(
        load_recipe("distillation").TaskArguments, launch.split("recipes/distillation.py ")[1].split()
    )
    assert args.effective_batch_size == 16 and task.student_layers == 3 and task.max_seq_length == 96


def tiny_idefics3():
    from transformers import Idefics3Config

    text = tiny_llama().to_dict()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4)  # fmt: skip
    return Idefics3Config(text_config=text, vision_config=vision, scale_factor=2, image_token_id=500)


def tiny_qwen2_5_vl():
    """Window attention in 16 px windows of 32 px images (4 per image), full attention in blocks 1 and 3."""
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})  # fmt: skip
    vision = dict(depth=4, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1, 3])  # fmt: skip
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=500, vision_start_token_id=501,
                            vision_end_token_id=502)  # fmt: skip


@pytest.mark.parametrize("config_fn, image_size", [(tiny_idefics3, 16), (tiny_qwen2_5_vl, 32)])
def test_a_vision_language_trace_runs_the_models_own_image_code_and_matches_real_tensors(config_fn, image_size):
    """Idefics3 picks its real images with a mask, Qwen2.5-VL loops over image grids and windows: with the
    layout held as constants the fake trace runs that code, and its peak is the real run's; the tower's
    activations count once it trains; LoRA's copy of the connector (modules_to_save) is counted."""
    settings = dict(task="vision_language", micro_batch_size=2, seq_len=40, images_per_sample=2, image_size=image_size)
    lora = dict(lora_r=4, train_vision_tower=True)  # LoRA on the text, the tower and connector copied whole
    fake = tracing.trace_step(config_fn(), **settings, **lora)
    assert fake.peak == pytest.approx(
        tracing.trace_step(config_fn(), **settings, **lora, real_tensors=True).peak, rel=0.02
    )
    frozen = tracing.trace_step(config_fn(), **settings)
    trained = tracing.trace_step(config_fn(), **settings, train_vision_tower=True)
    assert trained.activations_gradients_temporaries > frozen.activations_gradients_temporaries
    assert trained.optimizer_state > frozen.optimizer_state


def test_a_vision_language_plan_states_its_images_and_is_a_run_of_the_vision_recipe(tmp_path):
    from ft_accum.testing import load_recipe
    from ft_accum.training.arguments import parse_args

    config_file = tmp_path / "config.json"
    config_file.write_text(tiny_qwen2_5_vl().to_json_string())
    settings = dict(task="vision_language", seq_len=96, effective_batch_size=2, gpu_memory_gib=12, precision="fp32",
                    image_size=32, images_per_sample=2, lora_r=4, train_vision_tower=True)  # fmt: skip
    result = mp.plan(str(config_file), **settings)
    assert result["image_tokens_per_image"] == (32 // 4) ** 2 // 2**2  # 64 patches, merged 2 × 2
    assert result["vision_tower_parameters"] > 0
    flags = result["launch"].split("recipes/vision_language.py ")[1].split()
    assert "--train_vision_tower" in flags and "--max_seq_length" in flags
    task, args = parse_args(load_recipe("vision_language").TaskArguments, flags)
    assert (task.train_vision_tower, task.use_lora, task.max_seq_length) == (True, True, 96)
    with pytest.raises(ConfigError, match=r"2 image\(s\) of 32 px are 36 tokens, no room in --seq_len 30"):
        mp.plan(str(config_file), **(settings | {"seq_len": 30}))
