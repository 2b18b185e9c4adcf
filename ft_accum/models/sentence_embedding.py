"""Sentence embeddings from a Transformers encoder, and the files that make its folder a sentence-transformers model.

all-MiniLM-L6-v2, like most sentence-transformers bi-encoders, is `AutoModel` → mean pooling over the
real tokens → unit length (Reimers and Gurevych 2019, arXiv:1908.10084, §3: mean pooling). The same
three modules, written as sentence-transformers' `modules.json` beside `save_pretrained`'s files, let
`SentenceTransformer(path)` load the folder and compute the same embeddings.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F


def mean_pooling(last_hidden_state: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, d]: Σ_t mask_t · h_t / Σ_t mask_t, the mean of the real tokens' hidden states (padding excluded)."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    return (last_hidden_state * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def sentence_embeddings(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, d] unit-length mean-pooled embeddings of `model` (an encoder returning `last_hidden_state`)."""
    hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return F.normalize(mean_pooling(hidden, attention_mask), dim=-1)


def sentence_transformers_files(hidden_size: int, max_seq_length: int) -> dict[str, str]:
    """{relative path: text} of sentence-transformers' module files for Transformer → mean Pooling →
    Normalize, as all-MiniLM-L6-v2 ships them (sentence-transformers' `SentenceTransformer.save`)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    pooling = {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    return {
        "modules.json": json.dumps(modules, indent=2),
        "sentence_bert_config.json": json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False}, indent=2),
        "1_Pooling/config.json": json.dumps(pooling, indent=2),  # Normalize has no settings, so no file
    }
