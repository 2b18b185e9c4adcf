"""Check a written GGUF against the Hugging Face model it came from: in a real llama.cpp (xllamacpp,
the `[export]` extra), or, without it, by transformers' own GGUF reader.

In llama.cpp: each prompt (through the chat template for a chat model, as llama-server, Ollama and
LM Studio apply it) is continued greedily for `num_tokens` tokens with end-of-generation ignored, and
llama.cpp's top-1 token at every position is compared with Hugging Face's top-1 on the same prefix
(one teacher-forced forward over the prompt and llama.cpp's continuation). Teacher forcing keeps one
early disagreement from turning every later position into a disagreement, and lets a near-tie be
told from a real difference: where the two differ, the gap is how far below its own best Hugging
Face ranks llama.cpp's choice, in nats.

- F16, BF16, F32: every position must agree, or be a near-tie (gap ≤ `near_tie`, where rounding the
  weights to 16 bits may flip the order).
- Q8_0: the agreement rate must reach `Q8_0_MIN_AGREEMENT` (README: what it measures on SmolLM2).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ft_accum.core.errors import ConfigError

CHAT_PROMPTS = ("What is the capital of France?", "Write one sentence about the sea.", "What is 12 plus 30?")
TEXT_PROMPTS = ("The history of the city begins", "Scientists have found that", "The match ended when")
NEAR_TIE_NATS = 0.05  # f16 weights move SmolLM2's log-probs by ~1e-3; a top-2 closer than this may swap
Q8_0_MIN_AGREEMENT = 0.90  # measured: 0.93-0.97 on SmolLM2-135M (benchmarks/README.md); below 0.9 is a bug
INSTALL_HINT = 'pip install -e ".[export]" (xllamacpp: llama.cpp with prebuilt CPU wheels)'


@dataclass
class PromptResult:
    prompt: str
    positions: int
    agreed: int
    near_ties: list[float] = field(default_factory=list)  # the gap at each disagreement that is a near-tie
    worst_gap: float = 0.0  # the largest gap at a disagreement (0 when all agree)
    prompt_tokens_hf: int = 0
    prompt_tokens_llamacpp: int = 0
    text: str = ""


@dataclass
class CheckResult:
    outtype: str
    prompts: list[PromptResult]
    passed: bool
    summary: str


def llamacpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xllamacpp") is not None


@contextlib.contextmanager
def quiet_stderr(log_path: Path):
    """llama.cpp logs every load and request to the C-level stderr; send it to `log_path` meanwhile."""
    saved = os.dup(2)
    with open(log_path, "ab") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def prompt_messages(tokenizer, prompts: tuple[str, ...] | None) -> list:
    """The prompts as chat messages for a tokenizer with a chat template, else as plain text."""
    if tokenizer.chat_template:
        return [[{"role": "user", "content": text}] for text in prompts or CHAT_PROMPTS]
    return list(prompts or TEXT_PROMPTS)


def hf_prompt_ids(tokenizer, prompt) -> list[int]:
    """What the HF side feeds the model: the rendered chat with the generation prompt, or the text with
    the tokenizer's own special tokens (BOS where it adds one, as llama.cpp does from add_bos_token)."""
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def llamacpp_continuations(gguf_path: Path, prompts: list, num_tokens: int, log_path: Path) -> list[dict]:
    """For each prompt: llama.cpp's greedy continuation (end-of-generation ignored) as token ids, and its
    top-1 at each position (reported before the EOS ban, so an EOS it wanted still counts as its choice)."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(gguf_path)
    params.n_ctx = 1024
    params.n_parallel = 1
    params.cpuparams.n_threads = max(1, min(4, os.cpu_count() or 1))
    params.cpuparams_batch.n_threads = params.cpuparams.n_threads
    request = {"temperature": 0, "ignore_eos": True, "cache_prompt": False, "seed": 0}
    results = []
    with quiet_stderr(log_path):
        server = xllamacpp.Server(params)
        try:
            for prompt in prompts:
                if isinstance(prompt, list):  # llama.cpp renders the GGUF's own chat template
                    reply = server.handle_chat_completions(
                        {**request, "messages": prompt, "max_tokens": num_tokens, "logprobs": True, "top_logprobs": 1}
                    )
                else:
                    reply = server.handle_completions(
                        {**request, "prompt": prompt, "n_predict": num_tokens, "n_probs": 1}
                    )
                if "error" in reply or not reply.get("choices"):
                    raise ConfigError(f"llama.cpp refused the GGUF's request: {reply.get('error', reply)}")
                content = reply["choices"][0]["logprobs"]["content"]
                results.append(
                    {
                        "tokens": [c["id"] for c in content],
                        "top1": [c["top_logprobs"][0]["id"] if c.get("top_logprobs") else c["id"] for c in content],
                        "prompt_tokens": reply["usage"]["prompt_tokens"],
                    }
                )
        finally:
            del server
    return results


@torch.no_grad()
def compare_prompt(model, tokenizer, prompt, continuation: dict, near_tie: float) -> PromptResult:
    """Hugging Face's top-1 on llama.cpp's prefix at each position, against llama.cpp's top-1."""
    ids = hf_prompt_ids(tokenizer, prompt)
    tokens = continuation["tokens"]
    logits = model(torch.tensor([ids + tokens], device=model.device)).logits[
        0, len(ids) - 1 : len(ids) - 1 + len(tokens)
    ]
    log_probs = logits.float().log_softmax(-1)
    best = log_probs.argmax(-1).tolist()
    result = PromptResult(
        prompt=prompt if isinstance(prompt, str) else prompt[-1]["content"],
        positions=len(tokens),
        agreed=0,
        prompt_tokens_hf=len(ids),
        prompt_tokens_llamacpp=continuation["prompt_tokens"],
        # What a chat shows: the answer up to its end of turn (the comparison goes on past it, EOS ignored).
        text=tokenizer.decode(
            tokens[: tokens.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in tokens else tokens
        ),
    )
    for position, (theirs, ours) in enumerate(zip(continuation["top1"], best)):
        if theirs == ours:
            result.agreed += 1
            continue
        gap = float(log_probs[position, ours] - log_probs[position, theirs])
        result.worst_gap = max(result.worst_gap, gap)
        if gap <= near_tie:
            result.near_ties.append(gap)
    return result


def verdict(outtype: str, prompts: list[PromptResult], near_tie: float) -> tuple[bool, str]:
    positions = sum(p.positions for p in prompts)
    agreed = sum(p.agreed for p in prompts)
    ties = sum(len(p.near_ties) for p in prompts)
    tokenized_alike = all(p.prompt_tokens_hf == p.prompt_tokens_llamacpp for p in prompts)
    prompt_note = "" if tokenized_alike else "; the prompts were tokenized to different lengths"
    if outtype == "q8_0":
        rate = agreed / max(positions, 1)
        passed = rate >= Q8_0_MIN_AGREEMENT and tokenized_alike
        return passed, (
            f"top-1 agreement {agreed}/{positions} = {rate:.3f} (needs ≥ {Q8_0_MIN_AGREEMENT}){prompt_note}"
        )
    passed = agreed + ties == positions and tokenized_alike
    worst = max((p.worst_gap for p in prompts), default=0.0)
    return passed, (
        f"greedy top-1 identical at {agreed}/{positions} positions"
        + (f", {ties} near-tie(s) within {near_tie} nats" if ties else "")
        + (f"; the worst disagreement is {worst:.3f} nats below HF's best" if agreed + ties < positions else "")
        + prompt_note
    )


def check_in_llamacpp(
    gguf_path: Path,
    model,
    tokenizer,
    *,
    outtype: str,
    num_tokens: int = 32,
    prompts: tuple[str, ...] | None = None,
    near_tie: float = NEAR_TIE_NATS,
    log_path: Path | None = None,
) -> CheckResult:
    """Run the GGUF in llama.cpp and compare with `model` (the Hugging Face model it was written from)."""
    if not llamacpp_available():
        raise ConfigError(f"the llama.cpp check needs xllamacpp; {INSTALL_HINT}")
    messages = prompt_messages(tokenizer, prompts)
    log_path = log_path or Path(tempfile.gettempdir()) / f"ft_accum_llamacpp_{os.getpid()}.log"
    continuations = llamacpp_continuations(Path(gguf_path), messages, num_tokens, log_path)
    model.eval()
    results = [compare_prompt(model, tokenizer, p, c, near_tie) for p, c in zip(messages, continuations)]
    passed, summary = verdict(outtype, results, near_tie)
    return CheckResult(outtype=outtype, prompts=results, passed=passed, summary=summary)


@torch.no_grad()
def check_with_transformers(gguf_path: Path, model, tokenizer, prompts: tuple[str, ...] | None = None) -> dict:
    """transformers' own GGUF reader (`from_pretrained(gguf_file=...)`, which dequantizes and undoes the
    Q/K permutation) against `model`: the largest logit difference, the top-1 agreement over every
    prompt position, and whether the tokenizer read back from the GGUF tokenizes the prompts alike."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    reread = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    reread_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model.eval()
    max_difference, agreed, positions, same_tokens = 0.0, 0, 0, True
    for prompt in prompt_messages(tokenizer, prompts):
        ids = hf_prompt_ids(tokenizer, prompt)
        text = tokenizer.decode(ids)
        same_tokens &= (
            reread_tokenizer(text, add_special_tokens=False)["input_ids"]
            == tokenizer(text, add_special_tokens=False)["input_ids"]
        )
        inputs = torch.tensor([ids])
        ours, theirs = model(inputs).logits[0].float(), reread(inputs).logits[0].float()
        max_difference = max(max_difference, float((ours - theirs).abs().max()))
        agreed += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        positions += len(ids)
    return {"max_logit_difference": max_difference, "top1_agreement": agreed / positions, "same_tokens": same_tokens}
