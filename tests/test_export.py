"""ft-accum export --format gguf (issue 44): GGUF files checked in a real llama.cpp (xllamacpp) and in
transformers' GGUF reader, the Ollama TEMPLATE rendered by Go's own text/template, the model card, and
the bad inputs: no final/, an architecture that is not Llama, an existing output, a kill mid-write."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAULT_HOOKS, ROOT, launch, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ft_accum.cli.main import main
from ft_accum.core.errors import ConfigError
from ft_accum.export import gguf_file, llamacpp_check, ollama, source_model, vocab
from ft_accum.testing import make_conversations, make_tiny_chat_lm, render_with_go

needs_llamacpp = pytest.mark.skipif(
    not llamacpp_check.llamacpp_available(), reason=f"xllamacpp is not installed; {llamacpp_check.INSTALL_HINT}"
)
needs_go = pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain (apt-get install golang-go)")
# A random tiny model's next-token distribution is nearly flat, so its top-2 are often within rounding
# of each other: llama.cpp's choice must be one HF ranks within this many nats of its best. f16 rounding
# of 64-wide weights moves these log-probs by ~1e-3 (a wrong Q/K permutation moves them by > 0.1).
TINY_TIE_NATS = 0.02


def export(*args: str) -> int:
    return main(["export", *map(str, args)])


# A random Llama at the usual init (std 0.02) predicts nearly the same token whatever the context, so
# a GGUF whose attention is wrong (Q/K not permuted) still "agrees" with it; weights 5× larger make the
# predictions depend on the prompt and its order (test_a_wrong_q_k_permutation_fails_the_check).
WEIGHT_SCALE = 5.0


@pytest.fixture(scope="module")
def tiny_chat_llama(tmp_path_factory) -> Path:
    """A 2-layer, 64-wide Llama with SmolLM2's real tokenizer and ChatML template, tied embeddings."""
    path = make_tiny_chat_lm(tmp_path_factory.mktemp("tiny_chat_llama"), width=64)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.mul_(WEIGHT_SCALE)
    model.config.tie_word_embeddings = True  # as SmolLM2: the output layer is the embedding
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llama3_gqa(tmp_path_factory, tiny_chat_llama) -> Path:
    """What SmolLM2 does not exercise: grouped-query attention (4 query heads, 1 KV head, so K is permuted
    per KV head), Llama 3.1's RoPE scaling (rope_freqs), a separate output layer, attention biases."""
    path = tmp_path_factory.mktemp("tiny_llama3_gqa")
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_llama)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False, attention_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, initializer_range=0.02 * WEIGHT_SCALE,
    )  # fmt: skip
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # biases at 0 would hide a bias that is not permuted like its weight
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def check(gguf: Path, model_dir: Path, outtype: str, near_tie: float) -> llamacpp_check.CheckResult:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return llamacpp_check.check_in_llamacpp(gguf, model, tokenizer, outtype=outtype, near_tie=near_tie)


@needs_llamacpp
@pytest.mark.parametrize("model", ["tiny_chat_llama", "tiny_llama3_gqa"])
def test_a_tiny_llama_runs_in_llamacpp_as_in_transformers(model, request, tmp_path):
    model_dir = request.getfixturevalue(model)
    for outtype in ("f16", "q8_0"):
        gguf = tmp_path / f"{outtype}.gguf"
        assert export(model_dir, "--format", "gguf", "--outtype", outtype, "--output", gguf, "--no_verify") == 0
        result = check(gguf, model_dir, outtype, near_tie=TINY_TIE_NATS if outtype == "f16" else 0.1)
        for prompt in result.prompts:
            assert prompt.prompt_tokens_hf == prompt.prompt_tokens_llamacpp, prompt
            # every llama.cpp choice is HF's best or a near-tie of it (q8_0: rounding to 8 bits moves more)
            assert prompt.worst_gap <= (TINY_TIE_NATS if outtype == "f16" else 0.1), prompt
        assert result.passed or outtype == "q8_0", result.summary


@needs_llamacpp
def test_a_wrong_q_k_permutation_fails_the_check(tiny_llama3_gqa, tmp_path, monkeypatch):
    """The control: the same export without the Q/K permutation must not pass (the check can fail)."""
    monkeypatch.setattr(gguf_file, "permute_for_rope", lambda weight, num_heads: weight)
    gguf = tmp_path / "unpermuted.gguf"
    assert export(tiny_llama3_gqa, "--format", "gguf", "--output", gguf, "--no_verify") == 0
    result = check(gguf, tiny_llama3_gqa, "f16", near_tie=TINY_TIE_NATS)
    assert not result.passed and max(p.worst_gap for p in result.prompts) > 10 * TINY_TIE_NATS


def test_without_llamacpp_the_export_says_how_to_install_it_and_checks_with_transformers(
    tiny_chat_llama, tmp_path, monkeypatch, capsys
):
    """The check without llama.cpp: transformers' GGUF reader (which undoes the Q/K permutation) gives the
    same logits as the model to f16 rounding, and the tokenizer it rebuilds from the GGUF tokenizes alike.
    (It reads neither rope_freqs nor attention biases, so it is no check of the Llama 3.1-style model.)"""
    monkeypatch.setattr(llamacpp_check, "llamacpp_available", lambda: False)
    assert export(tiny_chat_llama, "--format", "gguf", "--output", tmp_path / "model.gguf") == 0
    printed = capsys.readouterr().out
    assert "llama.cpp is not installed" in printed and 'pip install -e ".[export]"' in printed
    difference = re.search(r"transformers round trip \(not llama.cpp\): max logit difference ([0-9.]+)", printed)
    assert difference and float(difference.group(1)) < 2e-2  # f16 weights; a wrong permutation differs by O(1)
    assert "tokenizer identical" in printed


def test_norms_are_f32_and_a_tied_output_is_written_once(tiny_chat_llama, tiny_llama3_gqa, tmp_path):
    import gguf

    for model_dir, tied in ((tiny_chat_llama, True), (tiny_llama3_gqa, False)):
        path = tmp_path / f"{model_dir.name}.gguf"
        assert export(model_dir, "--format", "gguf", "--outtype", "q8_0", "--output", path, "--no_verify") == 0
        reader = gguf.GGUFReader(path)
        types = {t.name: t.tensor_type for t in reader.tensors}
        assert all(kind == gguf.GGMLQuantizationType.F32 for name, kind in types.items() if "norm" in name)
        assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
        assert ("output.weight" in types) == (not tied)
        assert ("rope_freqs.weight" in types) == (not tied)  # only the Llama 3.1-style model scales RoPE
        fields = reader.fields
        assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-2"
        assert "tokenizer.chat_template" in fields


def test_the_pre_tokenizer_is_named_from_the_tokenizer_json():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert vocab.bpe_pre_tokenizer_name({"pre_tokenizer": byte_level}) == "gpt-2"
    digits = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    assert vocab.bpe_pre_tokenizer_name({"pre_tokenizer": digits}) == "smollm"
    llama3 = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": vocab.LLAMA3_SPLIT}, "behavior": "Isolated"},
            {**byte_level, "use_regex": False},
        ],
    }
    assert vocab.bpe_pre_tokenizer_name({"pre_tokenizer": llama3}) == "llama-bpe"
    with pytest.raises(ConfigError, match="Metaspace.*convert_hf_to_gguf"):
        vocab.bpe_pre_tokenizer_name({"pre_tokenizer": {"type": "Metaspace"}})


@needs_llamacpp
@pytest.mark.parametrize("pre_tokenizer", ["smollm", "llama-bpe"])
def test_llamacpp_tokenizes_like_hf_under_each_named_pre_tokenizer(pre_tokenizer, tiny_chat_llama, tmp_path):
    """SmolLM2's vocabulary behind the Digits and the Llama 3 pre-tokenizers: on text full of digits,
    spaces and punctuation, llama.cpp (told the pre-tokenizer's name) splits the prompt into as many
    tokens as HF, and continues it alike."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_chat_llama, model_dir)
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    byte_level = tokenizer_json["pre_tokenizer"]
    steps = {
        "smollm": [{"type": "Digits", "individual_digits": True}, byte_level],
        "llama-bpe": [
            {"type": "Split", "pattern": {"Regex": vocab.LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            {**byte_level, "use_regex": False},
        ],
    }[pre_tokenizer]
    tokenizer_json["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": steps}
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (model_dir / "chat_template.jinja").unlink()  # plain text prompts: the tokenizer alone decides
    gguf = tmp_path / "model.gguf"
    assert export(model_dir, "--format", "gguf", "--output", gguf, "--no_verify") == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = ("In 2024, 1234567 people paid $3.50 each!!", "Don't   stop:\n\n  it's 12:45 ... OK?")
    counts = [len(tokenizer(p)["input_ids"]) for p in prompts]
    if pre_tokenizer == "llama-bpe":  # the split matters on these prompts (SmolLM2's merges join no digits)
        gpt2 = AutoTokenizer.from_pretrained(tiny_chat_llama)
        assert [tokenizer(p)["input_ids"] for p in prompts] != [gpt2(p)["input_ids"] for p in prompts]
    result = llamacpp_check.check_in_llamacpp(gguf, model, tokenizer, outtype="f16", prompts=prompts, near_tie=0.02)
    assert [p.prompt_tokens_llamacpp for p in result.prompts] == counts
    assert result.passed, result.summary


@needs_llamacpp
def test_a_sentencepiece_tokenizer_as_tinyllama_s_runs_in_llamacpp(tmp_path):
    """TinyLlama's and Llama 2's tokenizer family (SentencePiece converted to tokenizer.json, written as
    llama.cpp's "llama" tokenizer with scores): spaces, digits, an accent and an emoji that only byte
    fallback can spell tokenize to as many tokens in llama.cpp as in HF, with BOS, and continue alike."""
    from ft_accum.testing import make_sentencepiece_llama

    model_dir = make_sentencepiece_llama(tmp_path / "model")
    gguf = tmp_path / "model.gguf"
    assert export(model_dir, "--format", "gguf", "--output", gguf, "--no_verify") == 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = (
        "Hello world, 1234 naïve people paid $3.50!",
        "The minister said that   it would 🦙 act.",
        "Shares rose",
    )
    assert "<0xF0>" in tokenizer.convert_ids_to_tokens(tokenizer(prompts[1])["input_ids"])  # byte fallback in use
    result = llamacpp_check.check_in_llamacpp(gguf, model, tokenizer, outtype="f16", prompts=prompts, near_tie=0.02)
    assert [p.prompt_tokens_llamacpp for p in result.prompts] == [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert result.passed, result.summary


CHAT_TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
        "m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "zephyr (TinyLlama-Chat)": (
        "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + eos_token }}"
        "{% elif message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + eos_token }}"
        "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}"
        "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}{% endfor %}"
    ),
}
LLAMA2_TEMPLATE = (  # the system prompt folded into the first user turn: not a per-turn format
    "{% if messages[0]['role'] == 'system' %}{% set system = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + (system if loop.first else '') + message['content'] "
    "+ ' [/INST]' }}{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
TWO_TURNS = [
    {"role": "user", "content": "Which topic is this? Stocks rose 3%."},
    {"role": "assistant", "content": "business"},
    {"role": "user", "content": "And this one?\nThe team won 2-1."},
]


@needs_go
@pytest.mark.parametrize("template", ["smollm2", *CHAT_TEMPLATES])
def test_the_ollama_template_renders_a_conversation_as_the_chat_template(template, tiny_chat_llama, tmp_path):
    """Go's own text/template (what Ollama runs) renders the Modelfile's TEMPLATE on a two-turn
    conversation, with and without a system prompt, to exactly apply_chat_template's text."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_llama)
    strip_bos = False
    if template != "smollm2":
        tokenizer.chat_template = CHAT_TEMPLATES[template]
        tokenizer.eos_token = "<|endoftext|>"
        strip_bos = template == "llama3"  # Llama 3's tokenizer adds BOS itself (add_bos_token)
    go_template, why_not, _ = ollama.ollama_template(tokenizer, strip_bos=strip_bos)
    assert go_template is not None, why_not
    for system in (None, "Answer in one word."):
        conversation = ([{"role": "system", "content": system}] if system else []) + TWO_TURNS
        expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        if strip_bos:
            expected = expected.removeprefix(tokenizer.bos_token)
        # Ollama puts a Modelfile's SYSTEM first as a system turn: here the conversation's own.
        rendered = render_with_go(go_template, conversation, system or "", tmp_path)
        assert rendered == expected
        assert ollama.render_go_template(go_template, TWO_TURNS, system=system) == expected


def test_a_template_ollama_cannot_express_is_reported_and_left_out(tiny_chat_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_llama)
    tokenizer.chat_template = LLAMA2_TEMPLATE
    go_template, why_not, _ = ollama.ollama_template(tokenizer, strip_bos=True)
    assert go_template is None and why_not
    text = ollama.modelfile_text("m.gguf", None, why_not, ["</s>"], None)
    assert not any(line.startswith("TEMPLATE") for line in text.splitlines()) and "could not be written" in text


def test_bad_inputs_each_get_one_line_and_leave_no_file(tiny_chat_llama, tmp_path, capsys):
    from ft_accum.testing import make_tiny_lm

    run_dir = tmp_path / "unfinished"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    with pytest.raises(SystemExit, match="no final/ model: the run did not finish; resume it .*resume_command.txt"):
        export(run_dir, "--format", "gguf")
    with pytest.raises(SystemExit, match="does not exist"):
        export(tmp_path / "nowhere", "--format", "gguf")

    gpt2 = make_tiny_lm("gpt2", tmp_path / "gpt2")
    with pytest.raises(SystemExit, match="supports the Llama architecture .* not GPT2LMHeadModel"):
        export(gpt2, "--format", "gguf", "--output", tmp_path / "gpt2.gguf")
    assert not (tmp_path / "gpt2.gguf").exists()

    existing = tmp_path / "existing.gguf"
    existing.write_bytes(b"not to be lost")
    with pytest.raises(SystemExit, match="already exists; pass --overwrite"):
        export(tiny_chat_llama, "--format", "gguf", "--output", existing, "--no_verify")
    assert existing.read_bytes() == b"not to be lost"
    assert export(tiny_chat_llama, "--format", "gguf", "--output", existing, "--no_verify", "--overwrite") == 0
    assert existing.read_bytes()[:4] == b"GGUF"


def test_a_kill_mid_write_leaves_no_gguf_under_the_final_name(tiny_chat_llama, tmp_path):
    """SIGKILL while the tensors are being written: no file under the output's name (a hidden partial
    at most), and the next export removes the partial and writes the whole file."""
    output, marker = tmp_path / "model.gguf", tmp_path / "frozen"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULT_HOOKS), os.environ.get("PYTHONPATH", "")])}
    env["FT_ACCUM_FREEZE_IN_GGUF_WRITE"] = str(marker)
    command = [sys.executable, "-m", "ft_accum.cli.main", "export", str(tiny_chat_llama), "--format", "gguf"]
    process = subprocess.Popen([*command, "--output", str(output), "--no_verify"], env=env, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the export never reached the tensor data"
    partials = list(tmp_path.glob(".model.gguf.partial-*"))
    assert len(partials) == 1 and partials[0].stat().st_size > 0  # killed with part of the file written
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert not output.exists()
    assert export(tiny_chat_llama, "--format", "gguf", "--output", output, "--no_verify") == 0
    assert output.read_bytes()[:4] == b"GGUF" and not list(tmp_path.glob(".model.gguf.partial-*"))


def test_a_qlora_adapter_on_a_base_stored_quantized_is_refused(tmp_path, tiny_chat_llama):
    base = tmp_path / "base-bnb-4bit"
    shutil.copytree(tiny_chat_llama, base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (base / "config.json").write_text(json.dumps(config))
    run_dir = tmp_path / "run"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    with pytest.raises(ConfigError, match="stored quantized .bitsandbytes.*--base_model"):
        source_model.load_source_model(run_dir)


@pytest.mark.launch
def test_smollm2_after_a_short_lora_run_exports_and_matches_in_llamacpp(tmp_path):
    """The issue's acceptance path on the real bundled SmolLM2-135M-Instruct: a short LoRA run of the
    instruction recipe through `accelerate launch` (its card written, the export command its last
    line), then `ft-accum export` to F16 (llama.cpp's greedy top-1 identical to HF's at every position
    of three chat prompts), its Modelfile beside it. (Q8_0's export and agreement are
    test_a_tiny_llama_runs_in_llamacpp_as_in_transformers': the same code, a tenth of the time.)"""
    system = {"role": "system", "content": "Answer briefly."}  # every training conversation's: the Modelfile's SYSTEM
    rows = [{"messages": [system, *row["messages"]]} for row in make_conversations(24, seed=1)]
    data = {
        "train": write_jsonl(tmp_path / "train.jsonl", rows),
        "validation": write_jsonl(tmp_path / "validation.jsonl", make_conversations(4, seed=2)),
    }
    out = tmp_path / "run"
    result = launch(
        "instruction_tuning",
        ["--train_file", str(data["train"]), "--validation_file", str(data["validation"]), "--use_lora",
         "--lora_r", "4", "--per_device_train_batch_size", "4", "--effective_batch_size", "8", "--max_train_steps", "2",
         "--max_seq_length", "96", "--output_dir", str(out), "--learning_rate", "1e-3", "--max_new_tokens", "4"],
        timeout=600,
    )  # fmt: skip
    assert result.stdout.strip().splitlines()[-1].startswith(f"deploy it: ft-accum export {out} --format gguf")
    card = (out / "final" / "README.md").read_text()
    assert "[More Information Needed]" not in card
    assert "4 micro × 2 accumulation × 1 process(es) = 8 per update" in card and "r 4, alpha" in card
    assert "recipes/instruction_tuning.py" in card and "accelerate launch" in card and "eval_loss |" in card
    if not llamacpp_check.llamacpp_available():
        pytest.skip(f"xllamacpp is not installed; {llamacpp_check.INSTALL_HINT}")
    assert export(out, "--format", "gguf", "--outtype", "f16") == 0
    exports = {e["outtype"]: e for e in json.loads((out / "exports.json").read_text())["exports"]}
    assert exports["f16"]["verification"].startswith("llama.cpp: greedy top-1 identical at 96/96 positions")
    for entry in exports.values():
        modelfile = Path(entry["modelfile"]).read_text()
        assert modelfile.count('PARAMETER stop "<|im_end|>"') == 1 and 'SYSTEM """Answer briefly."""' in modelfile
        assert f"FROM ./{Path(entry['file']).name}" in modelfile and 'TEMPLATE """' in modelfile
    assert "instruction_tuning-f16.gguf" in (out / "final" / "README.md").read_text()
