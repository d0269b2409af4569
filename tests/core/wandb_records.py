"""Read back what an offline W&B run wrote: the records of its ``run-<id>.wandb`` transaction logs.

wandb 0.31 ships no Python reader of that file; the tracker has one (``log_records``: W&B's 7-byte header,
then LevelDB's log format, each record a public ``wandb_internal_pb2.Record``), used here too. A changed
header fails loudly (``log_records`` raises, naming it).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from relaunch.components.core.tracking.wandb_tracker import log_records


def records(path: str):
    """Every ``Record`` of one ``.wandb`` file, in order."""
    for record, _ in log_records(open(path, "rb").read()):  # an unknown header raises, naming it
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
