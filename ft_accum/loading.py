"""Loading a pretrained model or tokenizer with errors that name the fix, shared by every recipe."""

from __future__ import annotations

import os

from ft_accum.errors import ConfigError


def check_model_path(name: str) -> None:
    """A path-like --model_name_or_path must exist (a typo must not turn into a hub download attempt)."""
    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(
            f"--model_name_or_path {name} does not exist; pass a folder holding config.json, or a hub name"
        )


def load_pretrained(auto_class, name: str, trust_remote_code: bool = False, **kwargs):
    """`auto_class.from_pretrained(name, ...)`, with a one-line ConfigError instead of a deep traceback.

    ValueError is what transformers raises for a model that needs its own code while
    trust_remote_code is off; OSError covers a missing folder, file or hub name offline.
    """
    check_model_path(name)
    try:
        return auto_class.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        hint = (
            "pass --trust_remote_code only if you trust its code"
            if "trust_remote_code" in str(exc)
            else "pass a local folder, or go online for hub names"
        )
        raise ConfigError(f"could not load model {name!r}: {str(exc).strip().splitlines()[0]} ({hint})") from exc


def check_context_length(config, length: int, flag: str) -> None:
    """Refuse sequences longer than the position embeddings of the model `config` describes (they would index past them)."""
    context = getattr(config, "max_position_embeddings", None)
    if context and length > context:
        raise ConfigError(
            f"{flag} {length} is longer than the model's {context} positions; use {flag} {context} or less"
        )


def warm_start_encoder_decoder(name: str, tokenizer):
    """An EncoderDecoderModel whose encoder and decoder both start from the encoder checkpoint `name`.

    Rothe et al. 2020 ("Leveraging Pre-trained Checkpoints for Sequence Generation Tasks",
    arXiv:1907.12461): BERT-to-BERT warm starts beat random initialisation; only the decoder's
    cross-attention (and LM head transform) start untrained. Generation starts from [CLS] and
    stops at [SEP] (BOS/EOS for tokenizers without them).
    """
    from transformers import EncoderDecoderModel

    model = EncoderDecoderModel.from_encoder_decoder_pretrained(name, name)
    start = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    end = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    model.config.update({"decoder_start_token_id": start, "eos_token_id": end, "pad_token_id": tokenizer.pad_token_id})
    # No repeated trigrams: an undertrained warm start otherwise loops ("- 1 - 1 - 1"); the HF bert2bert recipe does the same.
    model.generation_config.update(
        decoder_start_token_id=start, eos_token_id=end, pad_token_id=tokenizer.pad_token_id, no_repeat_ngram_size=3
    )
    return freeze_encoder_pooler(model)


def freeze_encoder_pooler(model):
    """Freeze a BERT-style encoder's pooler inside an encoder-decoder; return the model.

    The decoder reads the encoder's token states, never its pooled [CLS] output, so the pooler
    gets no gradient. DDP waits for a gradient from every trainable parameter and fails at the
    second update ("Expected to have finished reduction in the prior iteration"), which is what the
    seq2seq recipe's offline default did on 2 processes (benchmarks/bench_ddp.py). It had no
    gradient anyway, so freezing it changes no update. T5 and BART have no pooler: a no-op.
    """
    pooler = getattr(getattr(model, "encoder", None), "pooler", None)
    if pooler is not None:
        pooler.requires_grad_(False)
    return model
