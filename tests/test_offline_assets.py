"""The offline default's weights and data: found without the hub, verified, and usable for training."""

import json

from ft_accum.offline_assets import (
    BBC_NUM_ARTICLES,
    BBC_TOPICS,
    bundled_minilm_dir,
    bundled_smollm2_dir,
    load_bbc_news,
)


def test_bbc_news_split_is_complete_and_stratified():
    data = load_bbc_news(seed=42)
    assert len(data["train"]) + len(data["validation"]) == BBC_NUM_ARTICLES
    assert data["train"].features["label"].names == list(BBC_TOPICS)
    assert set(data["validation"]["label"]) == set(range(len(BBC_TOPICS)))


def test_bundled_minilm_is_a_bert_folder():
    config = json.loads((bundled_minilm_dir() / "config.json").read_text())
    assert config["model_type"] == "bert" and config["hidden_size"] == 384


def test_converted_smollm2_is_a_plain_trainable_llama():
    path = bundled_smollm2_dir()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    # A leftover GGUF quantization_config makes the Trainer refuse to train the dequantized weights.
    assert "quantization_config" not in config
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
