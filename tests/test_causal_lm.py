"""Token-weighted accumulation for causal LMs, against real full-batch backward passes.

Tolerances (RTOL in conftest): fp32, dropout 0, the same tokens per update, so runs differ only in
summation order (~1e-7 relative). The naive mean-of-means method on the same data is off by more
than 1e-2, which each exactness test checks as its control.
"""

import importlib.util
import json
import sys

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from conftest import (
    RTOL,
    assert_same_run,
    error_of,
    launch_runs,
    make_documents,
    read_metrics,
    run_in_process,
    tiny_lm_args,
    write_jsonl,
)
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
)

from ft_accum.core.batch_arithmetic import BatchPlan
from ft_accum.core.loss_normalization import causal_lm_loss_sum
from ft_accum.models import loading
from ft_accum.testing import reset_accelerate_state
from ft_accum.training.windows import Window


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def rel(a, b):
    return float((a - b).norm() / b.norm())


def window_gradients(model_dir, docs, micro, accumulation, method):
    """The gradient at each optimizer step of a real Accelerate accumulation loop (weights fixed)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = [tokenizer(d["text"]) for d in docs]
    loader = DataLoader(rows, batch_size=micro, collate_fn=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    # As the recipes build it: each window, fetched before it runs, tells Accelerate when to sync.
    plugin = GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=method != "ours")
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    model, loader = accelerator.prepare(model, loader)
    grads = []
    try:
        if method == "ours":  # training/windows.py's Window: the window's target tokens counted first
            batches = list(loader)
            for start in range(0, len(batches), accumulation):
                window = Window(
                    accelerator,
                    batches[start : start + accumulation],
                    count_items=lambda batch: (batch["labels"][:, 1:] != -100).sum(),
                    plan=BatchPlan(micro, accumulation, 1),
                )
                for batch in window:
                    with accelerator.accumulate(model):
                        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                        accelerator.backward(causal_lm_loss_sum(logits, batch["labels"])[0] * window.scale)
                grads.append(flat_grad(model).clone())
                model.zero_grad()
            return grads
        for batch in loader:
            with accelerator.accumulate(model):  # the tutorial way: each micro-batch's mean loss, divided by N
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    grads.append(flat_grad(model).clone())
                    model.zero_grad()
    finally:
        reset_accelerate_state()
    return grads


def full_batch_gradient(model_dir, docs):
    """One backward of the model's own loss (its token mean) over all the window's sequences."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = DataCollatorForLanguageModeling(tokenizer, mlm=False)([tokenizer(d["text"]) for d in docs])
    model(**batch).loss.backward()
    return flat_grad(model)


@pytest.mark.parametrize(
    "micro, accumulation, windows", [(2, 4, [8, 8]), (3, 4, [12, 4])], ids=["micro2x4", "micro3-short-last-window"]
)
def test_token_weighted_accumulation_is_exact(tiny_lm_dir, micro, accumulation, windows):
    docs = make_documents(16, seed=21, min_words=12, max_words=62)  # 16 sequences of 12–62 tokens
    ours = window_gradients(tiny_lm_dir, docs, micro, accumulation, "ours")
    naive = window_gradients(tiny_lm_dir, docs, micro, accumulation, "naive")
    assert len(ours) == len(naive) == len(windows)
    start = 0
    for g_ours, g_naive, size in zip(ours, naive, windows):
        reference = full_batch_gradient(tiny_lm_dir, docs[start : start + size])
        start += size
        assert rel(g_ours, reference) <= RTOL
        assert rel(g_naive, reference) > 1e-2, "the control is as exact as ours: the test cannot tell them apart"


def test_causal_shift_counts_one_target_fewer_per_row():
    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    _, count = causal_lm_loss_sum(torch.zeros(2, 4, 10), labels)
    assert int(count) == 3  # (6, 7) and (9): not the 5 non-masked labels


def test_gradient_checkpointing_gives_the_same_gradients(tiny_llama_dir):
    docs = make_documents(6, seed=22, min_words=10, max_words=40)
    grads = []
    for checkpointing in (False, True):
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        if checkpointing:
            model.config.use_cache = False
            loading.enable_gradient_checkpointing(model)
        model.train()
        batch = DataCollatorForLanguageModeling(tokenizer, mlm=False)([tokenizer(d["text"]) for d in docs])
        model(**batch).loss.backward()
        grads.append(flat_grad(model))
    assert rel(grads[1], grads[0]) <= 1e-6


@pytest.fixture(scope="module")
def lm_full_batch_run(tmp_path_factory, tiny_gpt2_dir, lm_data_files):
    out = tmp_path_factory.mktemp("lm-full-batch")
    run_in_process(
        "causal_lm",
        tiny_lm_args(tiny_gpt2_dir, lm_data_files, out, per_device_train_batch_size=8, gradient_accumulation_steps=1),
    )
    return out


def assert_same_lm_run(out, reference):
    assert len(read_metrics(out)) == 3
    assert_same_run(out, reference)  # tokens_seen equal: the same target tokens in every update


def test_recipe_accumulation_matches_the_full_batch(tmp_path, tiny_gpt2_dir, lm_data_files, lm_full_batch_run):
    run_in_process(
        "causal_lm",
        tiny_lm_args(
            tiny_gpt2_dir, lm_data_files, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4
        ),
    )
    assert_same_lm_run(tmp_path, lm_full_batch_run)
    assert [m["lr"] for m in read_metrics(tmp_path)][-1] == 0.0


@pytest.mark.launch
def test_two_ddp_processes_match_one_process_when_the_rows_do_not_divide(
    tmp_path, tiny_gpt2_dir, llama_64_dir, lm_data_files
):
    """17 documents in windows of 2 micro × 2 accumulation × 2 processes: the last window holds one
    document, so process 1 gets only the rows Accelerate repeats to even out the batches.

    The same launch (ft_accum/testing/recipe_runs.py: each process imports everything once) runs
    QLoRA under DDP: a 4-bit base with 8-bit AdamW and checkpointing, against one process taking the
    whole batch at once (test_low_memory.py holds the other low-memory tests)."""
    settings = {"max_train_samples": 17, "optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 0}
    run_in_process(
        "causal_lm",
        tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path / "one", per_device_train_batch_size=8, **settings),
    )
    split = {"per_device_train_batch_size": 2, "effective_batch_size": 8}
    runs = {"ddp": tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path / "ddp", **split, **settings)}
    qlora = importlib.util.find_spec("bitsandbytes") is not None  # the [lowmem] extra
    if qlora:
        low_memory = {"use_lora": True, "load_in_4bit": True, "optim": "adamw_8bit", "gradient_checkpointing": True,
                      "learning_rate": 1e-2}  # fmt: skip
        run_in_process(
            "causal_lm",
            tiny_lm_args(llama_64_dir, lm_data_files, tmp_path / "qlora_one", per_device_train_batch_size=8,
                         **low_memory),
        )  # fmt: skip
        runs["qlora_ddp"] = tiny_lm_args(llama_64_dir, lm_data_files, tmp_path / "qlora_ddp", **split, **low_memory)
    result = launch_runs("causal_lm", list(runs.values()), num_processes=2, work_dir=tmp_path, lowmem=qlora)
    for run in runs:
        results = json.loads((tmp_path / run / "all_results.json").read_text())
        assert results["num_processes"] == 2, f"{run}: accelerate launch started one process, not two"
    assert "2 micro × 2 accumulation × 2 processes = 8 sequences per update" in result.stdout
    assert [m["samples_seen"] for m in read_metrics(tmp_path / "ddp")] == [8, 16, 17]
    assert_same_run(tmp_path / "ddp", tmp_path / "one")  # tokens_seen equal: only real tokens, over both ranks
    if qlora:
        assert "frozen float32/uint8" in result.stdout and "optimizer state float32/uint8" in result.stdout
        assert len(read_metrics(tmp_path / "qlora_ddp")) == 3
        # LoRA's tensors are under bitsandbytes' 4,096-element threshold, so their AdamW state is fp32:
        # the adapters match the full batch to fp32's bound.
        assert_same_run(tmp_path / "qlora_ddp", tmp_path / "qlora_one")


def test_lora_with_checkpointing_trains_and_saves_an_adapter_that_reloads(tmp_path, tiny_llama_dir):
    peft = pytest.importorskip("peft")
    train = write_jsonl(tmp_path / "train.jsonl", make_documents(40, seed=23))
    data = {"train": train, "validation": write_jsonl(tmp_path / "val.jsonl", make_documents(8, seed=24))}
    results = run_in_process(
        "causal_lm",
        tiny_lm_args(
            tiny_llama_dir,
            data,
            tmp_path / "out",
            use_lora=True,
            gradient_checkpointing=True,
            lora_r=4,
            learning_rate=3e-2,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_train_steps=10,
            num_train_epochs=2,
            merge_lora=True,
        ),
    )
    losses = [m["loss"] for m in read_metrics(tmp_path / "out")]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert results["eval_perplexity"] < results["initial_eval_perplexity"]

    final = tmp_path / "out" / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), final)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final_merged")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    torch.testing.assert_close(reloaded(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert not torch.allclose(base(input_ids=ids).logits, merged(input_ids=ids).logits), "the adapter changed nothing"


def test_packing_gives_full_blocks(tmp_path, tiny_gpt2_dir, lm_data_files):
    run_in_process(
        "causal_lm",
        tiny_lm_args(
            tiny_gpt2_dir,
            lm_data_files,
            tmp_path,
            packing=True,
            block_size=16,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_train_steps=2,
        ),
    )
    # Packed blocks have no padding: every update sees 4 blocks × 15 targets.
    assert [m["tokens_seen"] for m in read_metrics(tmp_path)] == [60, 120]


def test_lora_without_peft_names_the_extra(tmp_path, tiny_gpt2_dir, lm_data_files, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` raise ImportError
    message = error_of("causal_lm", tiny_lm_args(tiny_gpt2_dir, lm_data_files, tmp_path, use_lora=True))
    assert "--use_lora needs peft" in message and 'pip install -e ".[lm]"' in message


def test_auto_micro_batch_recovers_an_lm_update(tmp_path, tiny_gpt2_dir, lm_data_files, monkeypatch):
    """As for classification: an allocation refused whenever the micro-batch exceeds 2, in update 2."""
    from transformers import GPT2LMHeadModel

    forward, calls = GPT2LMHeadModel.forward, {"training": 0}

    def forward_that_runs_out_of_memory(self, input_ids=None, **kwargs):
        if self.training:
            calls["training"] += 1
            if input_ids.shape[0] > 2 and calls["training"] >= 4:
                torch.empty(1 << 62, dtype=torch.uint8)  # the CPU allocator refuses this
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(GPT2LMHeadModel, "forward", forward_that_runs_out_of_memory)
    auto, reference = tmp_path / "auto", tmp_path / "reference"
    run_in_process(
        "causal_lm",
        tiny_lm_args(
            tiny_gpt2_dir,
            lm_data_files,
            auto,
            per_device_train_batch_size=4,
            effective_batch_size=8,
            auto_micro_batch=True,
        ),
    )
    run_in_process(
        "causal_lm",
        tiny_lm_args(tiny_gpt2_dir, lm_data_files, reference, per_device_train_batch_size=2, effective_batch_size=8),
    )
    assert [r["per_device_train_batch_size"] for r in read_metrics(auto)] == [4, 2, 2]
    assert_same_run(auto, reference)
