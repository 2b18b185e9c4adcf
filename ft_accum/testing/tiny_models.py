"""Tiny models built from configs, with word-level tokenizers written here: a BERT, a tagger, a T5, causal LMs of several architectures, a chat LM, a SentencePiece Llama. Nothing is downloaded."""

from __future__ import annotations

import contextlib
import unittest.mock
from pathlib import Path

import torch

from ft_accum.testing.generated_data import COMMON, TOPICS


def make_tiny_bert(path: Path) -> Path:
    """A 2-layer, 32-wide BERT classifier with dropout 0, saved like a hub checkpoint."""
    from transformers import BertForSequenceClassification

    return save_tiny_bert(path, BertForSequenceClassification, num_labels=len(TOPICS))


def make_tiny_tagger(path: Path) -> Path:
    """A 2-layer, 32-wide BERT token classifier (3 labels, dropout 0) whose vocabulary has "##s", so
    that plural words split into two sub-tokens."""
    from transformers import BertForTokenClassification

    return save_tiny_bert(path, BertForTokenClassification, num_labels=3, extra_tokens=["##s"])


def save_tiny_bert(path: Path, model_class, num_labels: int, extra_tokens: list[str] | None = None) -> Path:
    """A 2-layer, 32-wide BERT `model_class` (dropout 0) and its word-level tokenizer over TOPICS and COMMON."""
    from transformers import BertConfig, BertTokenizerFast

    Path(path).mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(extra_tokens or [])] + sorted(
        {w for ws in TOPICS.values() for w in ws} | set(COMMON)
    )
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # transformers 5 takes the vocabulary as a dict and silently ignores vocab_file (every word
    # would become [UNK]); transformers 4 needs vocab_file. The length check catches either going wrong.
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    if len(tokenizer) != len(vocab):
        tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    assert len(tokenizer) == len(vocab) and tokenizer.unk_token_id not in tokenizer("the match")["input_ids"]
    if extra_tokens:
        assert tokenizer.tokenize("goals") == ["goal", "##s"]
    tokenizer.save_pretrained(path)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=num_labels,
    )
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
    return path


def make_tiny_t5(path: Path, tokenizer_dir: Path) -> Path:
    """A 1-layer, 32-wide T5 (stands for any hub T5/BART) with the tokenizer in `tokenizer_dir`."""
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(path)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.sep_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(path)
    return path


@contextlib.contextmanager
def counting_causal_lms():
    """Inside the block, record each causal LM built (`PreTrainedModel.__init__`) and each one copied
    (`copy.deepcopy`), by class name: {"built": [...], "copied": [...]}. A run that says it keeps one
    model in memory must build one and copy none."""
    import copy
    from unittest import mock

    from transformers import PreTrainedModel

    seen = {"built": [], "copied": []}
    init, deepcopy = PreTrainedModel.__init__, copy.deepcopy

    def counted_init(self, *args, **kwargs):
        if type(self).__name__.endswith("ForCausalLM"):
            seen["built"].append(type(self).__name__)
        init(self, *args, **kwargs)

    def counted_deepcopy(x, *args):
        if type(x).__name__.endswith("ForCausalLM"):
            seen["copied"].append(type(x).__name__)
        return deepcopy(x, *args)

    with (
        mock.patch.object(PreTrainedModel, "__init__", counted_init),
        mock.patch.object(copy, "deepcopy", counted_deepcopy),
    ):
        yield seen


def make_tiny_chat_lm(path: Path, width: int = 32, tokenizer_dir: Path | None = None, eos_scale: float = 1.0) -> Path:
    """A 2-layer, `width`-wide Llama with SmolLM2-135M-Instruct's real tokenizer and chat template (bundled,
    offline), or the tokenizer in `tokenizer_dir`. `eos_scale` multiplies the output layer's EOS row:
    at 60 its logit is large one way or the other, so sampled completions stop early at some
    positions and run to the length limit at others (the GRPO tests' unequal lengths)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ft_accum.data.offline_assets import bundled_smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or bundled_smollm2_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= eos_scale
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_word_tokenizer(path: Path):
    """A word-level fast tokenizer with real pad and eos tokens, saved like a hub tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<unk>", "<eos>"] + sorted({w for ws in TOPICS.values() for w in ws} | set(COMMON))
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.save_pretrained(path)
    return tokenizer


def make_tiny_lm(arch: str, path: Path, width: int = 32, intermediate_size: int | None = None) -> Path:
    """A 2-layer, `width`-wide causal LM from a config (dropout 0, 64 positions), saved with its tokenizer.
    A Llama's MLP is `intermediate_size` wide (2 × `width` unless given).

    bitsandbytes' CPU 4-bit kernels need layers at least 64 wide (one quantization block)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tokenizer = build_word_tokenizer(path)
    common = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    }
    if arch == "gpt2":
        config = GPT2Config(
            n_embd=width,
            n_layer=2,
            n_head=2,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        model_class = GPT2LMHeadModel
    else:
        config = LlamaConfig(
            hidden_size=width,
            intermediate_size=intermediate_size or 2 * width,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attention_dropout=0.0,
            **common,
        )
        model_class = LlamaForCausalLM
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
    return path


def make_sentencepiece_llama(path: Path, vocab_size: int = 1200) -> Path:
    """A 2-layer, 64-wide Llama with a tokenizer shaped as TinyLlama's and Llama 2's: a SentencePiece
    model converted to tokenizer.json (BPE over '▁' pieces with byte fallback, <0x00>..<0xFF> after
    <unk> <s> </s>, BOS added), trained here on 300 bundled BBC articles; weights at init std 0.1."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from ft_accum.data.offline_assets import load_bbc_news

    texts = [row["text"] for row in load_bbc_news()["train"].select(range(300))]
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Split(
        "▁", behavior="merged_with_next"
    )  # training only: no merge across words
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    backend.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, limit_alphabet=80)
    )
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, initializer_range=0.1, bos_token_id=1, eos_token_id=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def tiny_bi_encoder(dropout: float, vocab_size: int = 50, hidden_size: int = 32):
    """A 2-layer BERT encoder (no head) from a config, seeded: the contrastive tests' bi-encoder."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        max_position_embeddings=32,
    )
    return BertModel(config, add_pooling_layer=False).train()  # the pooler is unused: DDP would wait for its gradient


def make_tiny_idefics3(path: Path, text_dir: Path) -> Path:
    """The offline default's layout at test size: an Idefics3 (SmolVLM) whose language model is the
    tiny chat LM in `text_dir` and whose SigLIP tower is 2 layers of 16, images of 16 px in 4 px patches
    (4 tokens per image), saved with its processor and chat template."""
    from transformers import AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig

    from ft_accum.data import offline_vlm

    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(offline_vlm.IMAGE_TOKENS)})
    text_config = LlamaConfig.from_pretrained(text_dir).to_dict() | {"vocab_size": len(tokenizer)}
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4
    )
    config = Idefics3Config(text_config=text_config, vision_config=vision, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))  # fmt: skip
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(path)
    processor = offline_vlm.assembled_processor(tokenizer, image_size=16, patch_size=4, scale_factor=2)
    processor.save_pretrained(path)
    return path


def make_tiny_qwen2_vl(path: Path, text_dir: Path):
    """(the model's folder, its processor) for a 2-layer, 32-wide Qwen2-VL (its 3-axis rope, flattened
    `pixel_values`, `image_grid_thw`) with a 2-block vision tower; the chat LM tokenizer of `text_dir`
    with Qwen2-VL's vision tokens added; an image processor that makes a 16 px image 4 tokens (a 4 × 4
    patch grid, merged 2 × 2). The processor is built in memory: Qwen2-VL's processor needs a video
    processor, which needs torchvision, which has no build beside the CPU torch here (it is
    constructed without it, and cannot be saved or loaded without it)."""
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    from ft_accum.data import offline_vlm

    tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                               min_pixels=16 * 16, max_pixels=16 * 16)  # fmt: skip
    template = offline_vlm.CHATML_VISION_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    with unittest.mock.patch.object(ProcessorMixin, "check_argument_for_proper_class"):
        processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
    return path, processor


def make_tiny_llava(path: Path, text_dir: Path) -> Path:
    """A tiny LLaVA: a 2-layer, 16-wide CLIP tower on 16 px images in 4 px patches (16 image tokens, the
    CLS token dropped), a 2-layer projector, the chat LM of `text_dir` as its language model, and
    its tokenizer with `<image>` added; saved with a LLaVA processor and the ChatML vision template."""
    from transformers import AutoTokenizer, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from ft_accum.data import offline_vlm

    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text_config = LlamaConfig.from_pretrained(text_dir).to_dict() | {"vocab_size": len(tokenizer)}
    vision = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, image_size=16, patch_size=4, projection_dim=16)  # fmt: skip
    config = LlavaConfig(vision_config=vision, text_config=text_config, vision_feature_layer=-1,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"))  # fmt: skip
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=4, num_additional_image_tokens=1,
                   vision_feature_select_strategy="default", chat_template=offline_vlm.CHATML_VISION_TEMPLATE,
                   ).save_pretrained(path)  # fmt: skip
    return path
