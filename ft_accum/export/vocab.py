"""A Hugging Face tokenizer as llama.cpp's GGUF vocabulary: tokens, their types, merges or scores,
the pre-tokenizer's name, the special token ids, whether BOS/EOS are added, and the chat template.

llama.cpp does not run the tokenizer.json: it re-implements each tokenizer family and picks one by
the GGUF keys `tokenizer.ggml.model` and `tokenizer.ggml.pre`. A wrong `pre` tokenizes digits,
spaces or punctuation differently from the model's training, and the model then reads text it has
never seen (one of the causes of a GGUF that "talks nonsense"). llama.cpp's own converter names the
pre-tokenizer by hashing the tokens of a probe text; here it is read from the structure of the
tokenizer.json's `pre_tokenizer`, which is what decides it, and anything unrecognised is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ft_accum.core.errors import ConfigError

# Meta's Llama 3 pre-tokenizer split (tokenizer.json of Meta-Llama-3-8B and 3.1/3.2), llama.cpp's "llama-bpe".
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# (pre-tokenizer steps, as (type, key settings)) → llama.cpp's tokenizer.ggml.pre, for byte-level BPE.
BYTE_LEVEL_PRE_TOKENIZERS = {
    (("ByteLevel", True),): "gpt-2",  # GPT-2's regex inside ByteLevel (the bundled SmolLM2's converted tokenizer)
    (("Digits", True), ("ByteLevel", True)): "smollm",  # SmolLM/SmolLM2 from the hub: every digit alone
    (("Split", LLAMA3_SPLIT), ("ByteLevel", False)): "llama-bpe",  # Llama 3, 3.1, 3.2
}


@dataclass
class GGUFVocab:
    """What a GGUF file carries of a tokenizer (the `tokenizer.ggml.*` and `tokenizer.chat_template` keys)."""

    model: str  # "gpt2": byte-level BPE with merges; "llama": SentencePiece-style, merged by score
    pre: str  # llama.cpp's pre-tokenizer name
    tokens: list[str]
    token_types: list[int]  # gguf.TokenType values
    merges: list[str] = field(default_factory=list)
    scores: list[float] | None = None
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad, ...
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None


def describe_pre_tokenizer(pre_tokenizer: dict | None) -> tuple:
    """The pre-tokenizer as ((type, setting), ...): the setting that changes the split for each step
    (ByteLevel's use_regex, Digits' individual_digits, Split's regex)."""
    if not pre_tokenizer:
        return ()
    steps = pre_tokenizer["pretokenizers"] if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    described = []
    for step in steps:
        kind = step.get("type")
        setting = {
            "ByteLevel": lambda s: s.get("use_regex", True),
            "Digits": lambda s: s.get("individual_digits", False),
            "Split": lambda s: (s.get("pattern") or {}).get("Regex", (s.get("pattern") or {}).get("String")),
        }.get(kind, lambda s: None)(step)
        described.append((kind, setting))
    return tuple(described)


def bpe_pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's name for a byte-level BPE tokenizer's pre-tokenizer, or a ConfigError naming what it is."""
    steps = describe_pre_tokenizer(tokenizer_json.get("pre_tokenizer"))
    name = BYTE_LEVEL_PRE_TOKENIZERS.get(steps)
    if name is None:
        found = " → ".join(f"{kind}({setting!r})" for kind, setting in steps) or "none"
        raise ConfigError(
            f"the tokenizer's pre-tokenizer ({found}) is not one ft-accum can name for llama.cpp; supported: "
            "GPT-2's ByteLevel (gpt-2), SmolLM's Digits + ByteLevel (smollm), Llama 3's split (llama-bpe). Convert "
            "this model with llama.cpp's convert_hf_to_gguf.py, which knows more tokenizers"
        )
    return name


def is_sentencepiece_bpe(tokenizer_json: dict) -> bool:
    """A SentencePiece model converted to tokenizer.json (Llama 2, TinyLlama, Mistral v0.1): BPE over '▁'
    pieces with byte fallback, as opposed to byte-level BPE (GPT-2, Llama 3, SmolLM)."""
    model = tokenizer_json.get("model", {})
    return model.get("type") == "BPE" and bool(model.get("byte_fallback"))


def read_vocab(tokenizer, tokenizer_dir: Path, vocab_size: int) -> GGUFVocab:
    """The GGUF vocabulary of `tokenizer`, as saved in `tokenizer_dir` (tokenizer.json and its config),
    padded with unused tokens to the model's `vocab_size` (its embedding rows)."""
    import gguf

    tokenizer_file = Path(tokenizer_dir) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ConfigError(
            f"{tokenizer_dir} has no tokenizer.json; GGUF export needs a fast tokenizer saved with the model "
            "(tokenizer.save_pretrained)"
        )
    tokenizer_json = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    if tokenizer_json.get("model", {}).get("type") != "BPE":
        raise ConfigError(
            f"the tokenizer in {tokenizer_dir} is a {tokenizer_json.get('model', {}).get('type')} model; GGUF export "
            "supports the BPE tokenizers of the Llama family (byte-level as Llama 3 and SmolLM2, or SentencePiece-style "
            "as Llama 2 and TinyLlama)"
        )
    if max(tokenizer.get_vocab().values()) >= vocab_size:
        raise ConfigError(
            f"the tokenizer has ids up to {max(tokenizer.get_vocab().values())} but the model only {vocab_size} "
            "embedding rows; resize the embeddings (model.resize_token_embeddings(len(tokenizer))) and save again"
        )
    sentencepiece = is_sentencepiece_bpe(tokenizer_json)
    by_id = {index: text for text, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types, scores = [], [], []
    for index in range(vocab_size):
        text = by_id.get(index)
        if text is None:  # embedding rows past the tokenizer (padded to a multiple): never produced
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
            tokens.append(text if added[index].special else text.replace("▁", " "))
        elif sentencepiece and text.startswith("<0x") and len(text) == 6 and text.endswith(">"):
            tokens.append(text)
            types.append(gguf.TokenType.BYTE)
        else:
            tokens.append(text)
            types.append(gguf.TokenType.NORMAL)
        # SentencePiece merges the pair whose piece scores highest; a converted tokenizer.json keeps no
        # scores, but its ids follow the merge order (the trainer appends each merge), so -id keeps the order.
        scores.append(-float(index) if types[-1] == gguf.TokenType.NORMAL else 0.0)

    special = gguf.SpecialVocab(tokenizer_dir, load_merges=not sentencepiece, n_vocab=vocab_size)
    with_specials = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return GGUFVocab(
        model="llama" if sentencepiece else "gpt2",
        pre="default" if sentencepiece else bpe_pre_tokenizer_name(tokenizer_json),
        tokens=tokens,
        token_types=[int(t) for t in types],
        merges=list(special.merges),
        scores=scores if sentencepiece else None,
        special_ids={k: v for k, v in special.special_token_ids.items() if v is not None and v < vocab_size},
        # What the HF tokenizer really does, not what a config claims: llama.cpp adds BOS/EOS by these flags.
        add_bos=bos is not None and with_specials[:1] == [bos] and without[:1] != [bos],
        add_eos=eos is not None and with_specials[-1:] == [eos] and without[-1:] != [eos],
        chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
    )


def add_vocab_to_gguf(writer, vocab: GGUFVocab) -> None:
    """Write `vocab` as the tokenizer.ggml.* keys (and the chat template) of a gguf.GGUFWriter."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    for kind, index in vocab.special_ids.items():
        add = getattr(writer, f"add_{kind}_token_id", None)
        if add is not None:
            add(index)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
