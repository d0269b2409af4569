"""Read back what an offline W&B run wrote: the records of its ``run-<id>.wandb`` transaction log.

wandb 0.31 ships no Python reader of that file, so this is one, from public parts only: the file is a
7-byte header (``:W&B``, magic ``0xBEE1``, version 0) followed by LevelDB's log format (32 KiB blocks; each
record fragment a 7-byte header: CRC32C, little-endian length, type FULL/FIRST/MIDDLE/LAST), and each
record is a ``wandb.proto.wandb_internal_pb2.Record`` protobuf (wandb's public generated module).
A changed header fails loudly here, by name.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass, field

HEADER = b":W&B"
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str):
    """Every ``Record`` of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    ident, magic, version = data[:4], struct.unpack("<H", data[4:6])[0], data[6]
    assert (ident, magic, version) == (HEADER, 0xBEE1, 0), f"{path}: unknown .wandb header {data[:7]!r}"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0 and length == 0:  # zero fill at the end of a file still being written
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, FIRST):
            pending = chunk
        else:
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@dataclass
class OfflineRun:
    """What the offline run folders of one W&B run id hold, in the order they were written."""

    run_ids: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    artifacts: list = field(default_factory=list)
    files: int = 0


def read_offline_runs(wandb_dir: str) -> OfflineRun:
    """Every offline run folder under ``wandb_dir`` (``WANDB_DIR``), oldest first, merged."""
    out = OfflineRun()
    folders = sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*")), key=os.path.getmtime)
    for folder in folders:
        for path in glob.glob(os.path.join(folder, "run-*.wandb")):
            out.files += 1
            for record in records(path):
                kind = record.WhichOneof("record_type")
                if kind == "run":
                    out.run_ids.append(record.run.run_id)
                elif kind == "history":
                    row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                           for item in record.history.item}
                    out.history.append(row)
                    out.steps.append(int(row["_step"]))
                elif kind == "config":
                    for item in record.config.update:
                        out.config[item.key] = json.loads(item.value_json)
                elif kind == "summary":
                    for item in record.summary.update:
                        out.summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
                elif kind == "artifact":
                    out.artifacts.append(record.artifact)
    return out
