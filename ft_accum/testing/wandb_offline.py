"""Read a W&B offline run's own record (`wandb/offline-run-*/run-*.wandb`) back, as W&B's sync would.

The file is LevelDB's log format (32 KiB blocks of records, each a 4-byte checksum, a 2-byte length, a
1-byte type: full, first, middle or last piece) after a 7-byte `:W&B` header, and each record is W&B's
own protobuf `Record` (`wandb.proto.wandb_internal_pb2`). wandb 0.19+ reads it in its Go core and
ships no Python reader, and `wandb sync --view` is gone: this is the few lines that read it.
"""

from __future__ import annotations

import json
from pathlib import Path

BLOCK_SIZE = 32768
HEADER = b":W&B"
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _pieces(data: bytes):
    position, record = 7, b""
    while position + 7 <= len(data):
        left = BLOCK_SIZE - position % BLOCK_SIZE
        if left < 7:  # a block's trailer: too short for a record header
            position += left
            continue
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        if kind == 0:  # zero padding to the end of the block
            position += left
            continue
        piece = data[position + 7 : position + 7 + length]
        position += 7 + length
        record = piece if kind in (FULL, FIRST) else record + piece
        if kind in (FULL, LAST):
            yield record


def read_offline_run(run_file: str | Path) -> tuple[dict[str, object], list[dict[str, object]]]:
    """(the run's config, its history rows: each `_step` and the values logged at it) from a .wandb file."""
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{run_file} is not a W&B run file (no {HEADER!r} header)")
    config, history = {}, []
    for raw in _pieces(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append(row)
        elif kind in ("config", "run"):  # the settings given at init come in the run record
            for item in (record.config if kind == "config" else record.run.config).update:
                value = json.loads(item.value_json)
                config[item.key] = value.get("value", value) if isinstance(value, dict) else value
    return config, history
