"""Load a dataset from the hub or from local files, with errors that say what to do.

Local files: txt (one row per line, column `text`), csv, tsv, json and jsonl (`datasets`
builders text, csv and json). Without a validation
split, 10% of the training set is held out with a fixed seed, so runs stay comparable.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from ft_accum.errors import ConfigError

_BUILDERS = {".txt": ("text", {}), ".csv": ("csv", {}), ".tsv": ("csv", {"delimiter": "\t"}), ".json": ("json", {}), ".jsonl": ("json", {})}


def load_local_files(train_file: str, validation_file: str | None = None) -> datasets.DatasetDict:
    """A DatasetDict from local csv/tsv/json/jsonl files (one format for both)."""
    files = {"train": train_file} | ({"validation": validation_file} if validation_file else {})
    for split, file in files.items():
        if not Path(file).is_file():
            raise ConfigError(f"--{split}_file {file} does not exist; check the path (relative to {Path.cwd()})")
    suffix = Path(train_file).suffix.lower()
    if suffix not in _BUILDERS:
        raise ConfigError(f"--train_file {train_file}: unsupported extension {suffix!r}; use one of {', '.join(_BUILDERS)}")
    builder, kwargs = _BUILDERS[suffix]
    header_lines = 1 if builder == "csv" else 0
    for split, file in files.items():
        if _count_nonblank_lines(file, stop_after=header_lines + 1) <= header_lines:
            raise ConfigError(f"--{split}_file {file} is empty (no data rows); give a file with at least one row")
    try:
        return datasets.load_dataset(builder, data_files=files, **kwargs)
    except Exception as exc:  # the builders raise many types, all with long tracebacks
        raise ConfigError(f"could not read {', '.join(files.values())} as {suffix[1:]}: {str(exc).splitlines()[0]}") from exc


def load_hub_dataset(dataset_name: str, dataset_config_name: str | None = None) -> datasets.DatasetDict:
    """`datasets.load_dataset(name, config)`, for users who are online."""
    try:
        return datasets.load_dataset(dataset_name, dataset_config_name)
    except Exception as exc:
        raise ConfigError(
            f"could not load dataset {dataset_name!r}: {str(exc).splitlines()[0]}; check the name, "
            "go online (unset HF_HUB_OFFLINE), or pass --train_file"
        ) from exc


def with_validation_split(raw: datasets.DatasetDict, seed: int, test_size: float = 0.1) -> datasets.DatasetDict:
    """Rename `test` to `validation`, or hold out `test_size` of `train` when there is neither."""
    if "train" not in raw:
        raise ConfigError(f"the dataset has no 'train' split, only {', '.join(raw)}")
    if "validation" in raw:
        return raw
    if "test" in raw:
        return datasets.DatasetDict(train=raw["train"], validation=raw["test"])
    split = raw["train"].train_test_split(test_size=test_size, seed=seed)
    return datasets.DatasetDict(train=split["train"], validation=split["test"])


def check_columns(raw: datasets.DatasetDict, **columns: str) -> None:
    """Every requested column exists in every split, and no split is empty."""
    for split, ds in raw.items():
        if len(ds) == 0:
            raise ConfigError(f"the {split} split is empty; give a file or dataset with at least one row")
        for flag, column in columns.items():
            if column not in ds.column_names:
                raise ConfigError(
                    f"--{flag} {column!r} is not a column of the {split} split; its columns are "
                    f"{', '.join(ds.column_names)} (pass --{flag} with one of them)"
                )


def _count_nonblank_lines(path: str, stop_after: int) -> int:
    count = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            count += bool(line.strip())
            if count >= stop_after:
                break
    return count
