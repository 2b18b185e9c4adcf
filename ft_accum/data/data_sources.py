"""Load a dataset from the hub or from local files, with errors that say what to do.

Local files: txt (one row per line, column `text`), csv, tsv, json and jsonl (`datasets`
builders text, csv and json). Without a validation
split, 10% of the training set is held out with a fixed seed, so runs stay comparable.
"""

from __future__ import annotations

import os
from pathlib import Path

import datasets
import torch

from ft_accum.core.errors import ConfigError

_BUILDERS = {
    ".txt": ("text", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".json": ("json", {}),
    ".jsonl": ("json", {}),
}


def load_local_files(train_file: str, validation_file: str | None = None) -> datasets.DatasetDict:
    """A DatasetDict from local csv/tsv/json/jsonl files (one format for both)."""
    files = {"train": train_file} | ({"validation": validation_file} if validation_file else {})
    for split, file in files.items():
        if Path(file).is_dir():
            raise ConfigError(f"--{split}_file {file} is a folder; pass the data file inside it")
        if not Path(file).is_file():
            raise ConfigError(f"--{split}_file {file} does not exist; check the path (relative to {Path.cwd()})")
    suffix = Path(train_file).suffix.lower()
    if suffix not in _BUILDERS:
        raise ConfigError(
            f"--train_file {train_file}: unsupported extension {suffix!r}; use one of {', '.join(_BUILDERS)}"
        )
    builder, kwargs = _BUILDERS[suffix]
    if validation_file and _BUILDERS.get(Path(validation_file).suffix.lower(), (None,))[0] != builder:
        raise ConfigError(
            f"--train_file {train_file} and --validation_file {validation_file} are of different formats; "
            f"give both as {suffix[1:]} (or both in another format)"
        )
    header_lines = 1 if builder == "csv" else 0
    for split, file in files.items():
        if _count_nonblank_lines(file, stop_after=header_lines + 1) <= header_lines:
            raise ConfigError(f"--{split}_file {file} is empty (no data rows); give a file with at least one row")
    for split, file in files.items():
        if not os.access(file, os.R_OK):
            raise ConfigError(
                f"--{split}_file {file} is not readable (permission denied); fix its permissions or copy it"
            )
    # Each file on its own: a validation file with extra columns is fine (the recipe reads only its own
    # columns, and check_columns names a missing one); `datasets` would refuse the two as one dict.
    splits = {}
    for split, file in files.items():
        try:
            splits[split] = datasets.load_dataset(builder, data_files={split: file}, **kwargs)[split]
        except Exception as exc:  # the builders raise many types, all with long tracebacks
            where = _first_bad_json_line(file) if builder == "json" else None
            reason = where or _read_error_hint(exc, builder)
            raise ConfigError(f"could not read {file} as {suffix[1:]}: {reason}") from exc
    return datasets.DatasetDict(splits)


def _first_bad_json_line(path: str) -> str | None:
    """For JSON Lines: the first line that is not one JSON object, named with its number, or None."""
    import json

    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.read(1)
        if first == "[":
            return None  # one JSON array (.json): not line by line
        f.seek(0)
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as exc:
                return f"line {number} is not valid JSON ({exc.msg}); write one JSON object per line"
            if not isinstance(value, dict):
                return f'line {number} is a JSON {type(value).__name__}, not an object; write one {{"column": value, ...}} per line'
    return None


def _read_error_hint(exc: BaseException, builder: str) -> str:
    """The innermost cause of a `datasets` builder failure (the outer one only says it failed), and the fix."""
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    lines = str(exc).strip().splitlines()
    reason = lines[0] if lines else type(exc).__name__
    if isinstance(exc, UnicodeDecodeError) or "utf8" in reason.lower().replace("-", ""):
        return f"{reason}; the file is not UTF-8: re-save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
    fix = {
        "json": "each line must be one JSON object, and a column must hold one type (all strings or all numbers)",
        "csv": "check the quoting (a field with a comma or line break must be in double quotes) and the column count",
    }
    return f"{reason}; {fix.get(builder, 'check the file format')}"


def check_text_column(raw: datasets.DatasetDict, text_column: str, flag: str = "--text_column") -> None:
    """The text column (the recipe's `flag`) holds strings (a CSV row with extra fields shifts numbers into it)."""
    for split, ds in raw.items():
        dtype = getattr(ds.features[text_column], "dtype", None)
        if dtype not in ("string", "large_string"):
            raise ConfigError(
                f"{flag} {text_column!r} of the {split} split holds {dtype or type(ds.features[text_column]).__name__} values, not text; "
                f"check that every CSV row has as many fields as the header, or pass the right {flag}"
            )


def drop_empty_rows(raw: datasets.DatasetDict, *columns: str) -> datasets.DatasetDict:
    """Drop rows whose `columns` are missing or blank (an empty CSV cell reads as None), then check none is left empty."""

    def keep(row):
        return all(row[c] is not None and str(row[c]).strip() != "" for c in columns)

    filtered = datasets.DatasetDict(
        {
            split: ds.filter(keep, desc=f"Dropping rows with an empty {' or '.join(columns)}")
            for split, ds in raw.items()
        }
    )
    for split, ds in filtered.items():
        if len(ds) == 0:
            raise ConfigError(
                f"the {split} split is empty after dropping the {len(raw[split])} row(s) with an empty {' or '.join(columns)}; "
                f"check that the file has values in column(s) {', '.join(columns)}, or pass the right column names"
            )
    return filtered


def check_no_empty_text(raw: datasets.DatasetDict, *columns: str) -> None:
    """Refuse a row whose `columns` hold an empty text, naming the first: where every column is one side
    of a pair (an anchor and its positive), dropping the row would silently drop its partner too."""
    for split, ds in raw.items():
        for column in columns:
            for index, text in enumerate(ds[column]):
                if text is None or not str(text).strip():
                    raise ConfigError(
                        f"row {index + 1} of the {split} split has an empty {column!r}; fill it in or remove the row"
                    )


def label_names(raw: datasets.DatasetDict, label_column: str) -> list[str]:
    """The classes, from the train split: a ClassLabel's names, or the sorted distinct values.

    Labels must be of one kind in every split (all integers or all strings): "1" from one file
    and 1 from another would otherwise become two classes. A validation label the train split
    never shows is an error, since the classifier has no output for it.
    """
    kinds = {split: ds.features[label_column] for split, ds in raw.items()}
    if hasattr(
        kinds["train"], "names"
    ):  # ClassLabel: every split shares the names; a class may still lack training rows
        names = list(kinds["train"].names)
        _check_seen_in_train({split: {names[i] for i in set(ds[label_column])} for split, ds in raw.items()}, "label")
        check_two_classes(sorted({names[i] for i in set(raw["train"][label_column])}), label_column)
        return names
    for split, ds in raw.items():
        value_types = sorted({type(v).__name__ for v in ds[label_column]})
        if len(value_types) > 1:
            raise ConfigError(
                f"--label_column {label_column!r} of the {split} split mixes {' and '.join(value_types)} values; "
                "write every label the same way (all names, or all integer ids)"
            )
    dtypes = {split: getattr(feature, "dtype", type(feature).__name__) for split, feature in kinds.items()}
    if len(set(dtypes.values())) > 1:
        raise ConfigError(
            f"--label_column {label_column!r} holds different kinds of value per split ({', '.join(f'{s}: {d}' for s, d in dtypes.items())}); "
            "write the labels the same way in every file (all names, or all integer ids)"
        )
    names = [str(v) for v in sorted(set(raw["train"][label_column]))]  # integer ids keep their numeric order
    _check_seen_in_train({split: {str(v) for v in set(ds[label_column])} for split, ds in raw.items()}, "label")
    check_two_classes(names, label_column)
    return names


def check_two_classes(present: list[str], label_column: str) -> None:
    """A classifier needs two classes in its training rows: with one, the loss is 0 from the start and
    every prediction is right by construction, so the run 'succeeds' and means nothing (issue 19)."""
    if len(present) < 2:
        found = repr(present[0]) if present else "none"
        raise ConfigError(
            f"--label_column {label_column!r} has a single class in the train split ({found}); a classifier needs "
            "rows of at least two classes: check the file, or the column"
        )


def _check_seen_in_train(names_by_split: dict[str, set[str]], kind: str) -> None:
    """A label (or tag) in another split that the train split never shows: the model never learns it."""
    seen = names_by_split["train"]
    for split, names in names_by_split.items():
        unknown = sorted(names - seen)
        if unknown:
            raise ConfigError(
                f"the {split} split has {kind}(s) {', '.join(unknown[:5])} that the train split never shows (it has {', '.join(sorted(seen)[:10])}); "
                f"fix the {kind}s, or move those rows into the train split"
            )


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


def check_columns(raw: datasets.DatasetDict, **columns: str) -> datasets.DatasetDict:
    """Every requested column exists in every split, and no split is empty; returns the splits with only
    those columns, so that other columns (which may differ between files) are ignored, not an error."""
    for split, ds in raw.items():
        if len(ds) == 0:
            raise ConfigError(f"the {split} split is empty; give a file or dataset with at least one row")
        for flag, column in columns.items():
            if column not in ds.column_names:
                raise ConfigError(
                    f"--{flag} {column!r} is not a column of the {split} split; its columns are "
                    f"{', '.join(ds.column_names)} (pass --{flag} with one of them)"
                )
    return datasets.DatasetDict(
        {split: ds.select_columns(list(dict.fromkeys(columns.values()))) for split, ds in raw.items()}
    )


def _count_nonblank_lines(path: str, stop_after: int) -> int:
    count = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            count += bool(line.strip())
            if count >= stop_after:
                break
    return count


def take_first_rows(raw, **limits: int | None):
    """Keep the first N rows of each named split (`train=640, validation=None`): quick runs on big sets."""
    for split, limit in limits.items():
        if limit:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))
    return raw


def seeded_dataloaders(
    tokenized: datasets.DatasetDict,
    collate_fn,
    per_device_train_batch_size: int,
    per_device_eval_batch_size: int,
    seed: int,
    eval_collate_fn=None,
):
    """(train, eval) DataLoaders, shuffled train, each with a torch.Generator of its own.

    Starting an iterator draws a base seed from the loader's generator, or else from the global
    torch RNG, which also drives dropout. A resumed run starts one iterator fewer, so with the
    global RNG its dropout masks would differ from the uninterrupted run's.
    """
    from torch.utils.data import DataLoader

    evaluation = DataLoader(
        tokenized["validation"],
        collate_fn=eval_collate_fn or collate_fn,
        batch_size=per_device_eval_batch_size,
        generator=torch.Generator().manual_seed(seed),
    )
    return seeded_train_dataloader(tokenized["train"], collate_fn, per_device_train_batch_size, seed), evaluation


def seeded_train_dataloader(dataset, collate_fn, batch_size: int, seed: int):
    """The shuffled training DataLoader with a generator of its own (see `seeded_dataloaders`)."""
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        shuffle=True,
        collate_fn=collate_fn,
        batch_size=batch_size,
        generator=torch.Generator().manual_seed(seed),
    )


def load_image_folder(train_dir: str, validation_dir: str | None = None) -> datasets.DatasetDict:
    """An `imagefolder` DatasetDict (one sub-folder per class gives `image` and `label`) from local folders."""
    folders = {"train": train_dir} | ({"validation": validation_dir} if validation_dir else {})
    for split, folder in folders.items():
        if not Path(folder).is_dir():
            raise ConfigError(
                f"--{split}_dir {folder} is not a folder; pass a folder with one sub-folder of images per class"
            )
    try:
        return datasets.load_dataset(
            "imagefolder", data_files={split: str(Path(folder) / "**") for split, folder in folders.items()}
        )
    except Exception as exc:  # the builder raises many types, all with long tracebacks
        raise ConfigError(
            f"could not read {' and '.join(folders.values())} as image folders: {str(exc).strip().splitlines()[0]} "
            "(expected one sub-folder of images per class)"
        ) from exc


def find_tags_column(ds: datasets.Dataset) -> str:
    """The one column named `*_tags` (CoNLL style: ner_tags, pos_tags …), for a --label_column left unset."""
    found = [c for c in ds.column_names if c.endswith("_tags")]
    if len(found) != 1:
        raise ConfigError(
            f"cannot tell the tag column from {', '.join(ds.column_names)} ({len(found)} end in _tags); pass --label_column"
        )
    return found[0]


def tag_names(raw: datasets.DatasetDict, tokens_column: str, label_column: str) -> list[str]:
    """The tag set of a token-classification DatasetDict: a ClassLabel's names, or the sorted distinct tags.

    Every row must hold as many tags as words, and a validation tag the train split never shows
    is an error, as for sequence labels (`label_names`).
    """
    for split, ds in raw.items():
        for i, (words, tags) in enumerate(zip(ds[tokens_column], ds[label_column])):
            if not isinstance(words, list) or not isinstance(tags, list) or len(words) != len(tags):
                kind = (
                    f"{len(words)} words and {len(tags)} tags"
                    if isinstance(words, list) and isinstance(tags, list)
                    else "no lists"
                )
                raise ConfigError(
                    f"row {i} of the {split} split has {kind} in --tokens_column {tokens_column!r} / --label_column "
                    f"{label_column!r}; each row needs a list of words and a list of as many tags"
                )
    feature = raw["train"].features[label_column]
    inner = getattr(feature, "feature", None)
    if inner is None and isinstance(feature, list) and feature:  # datasets ≥ 3 writes plain lists as [Value]
        inner = feature[0]
    to_name = inner.names.__getitem__ if hasattr(inner, "names") else str
    flat = {split: {to_name(t) for row in ds[label_column] for t in row} for split, ds in raw.items()}
    _check_seen_in_train(flat, "tag")
    return list(inner.names) if hasattr(inner, "names") else sorted(flat["train"])


def load_splits(
    *,
    train_file: str | None,
    validation_file: str | None,
    dataset_name: str | None,
    dataset_config_name: str | None,
    seed: int,
    bundled,
) -> datasets.DatasetDict:
    """train and validation splits from --train_file, --dataset_name, or `bundled(seed)` (the offline default).

    Without a validation split, 10% of train is held out with `seed` (`with_validation_split`).
    """
    if train_file and dataset_name:
        raise ConfigError("give --train_file or --dataset_name, not both")
    if train_file:
        raw = load_local_files(train_file, validation_file)
    elif dataset_name:
        raw = load_hub_dataset(dataset_name, dataset_config_name)
    else:
        raw = bundled(seed)
    return with_validation_split(raw, seed)
