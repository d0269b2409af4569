"""``relaunch checkpoints list|latest|verify --store URI [--training ID] [--step N] [--deep] [--json|--uris]``.

    relaunch checkpoints list   --store ./.relaunch/store              # every training `relaunch run` wrote
    relaunch checkpoints list   --store s3://bucket/exp/run --uris     # one full checkpoint URI a line
    relaunch checkpoints latest --store ./.relaunch/store --json       # what a resume would load (newest training)
    relaunch checkpoints verify --store ./.relaunch/store --training 20261204-030501
    relaunch checkpoints verify --store /shared/exp --step 1200        # manifest, files and sizes
    relaunch checkpoints verify --store /shared/exp --deep             # read and check every byte
    relaunch checkpoints export --store /shared/exp --to model.safetensors --format safetensors
    relaunch checkpoints import ./dcp-folder --store /shared/exp --step 5000 # adopt a dcp.save folder
    relaunch checkpoints import ./model-and-optimizer --store /shared/imported --step 500 --config my.yaml

list, latest and verify never take the write lease and never delete or overwrite a checkpoint; what
they write is a read lease on the step they read (checkpoints/readers/, removed when they end: retention
leaves that step alone meanwhile) and the quarantine marker of a damaged checkpoint they find
(checkpoints/quarantine/, created only if absent; docs/checkpoint-format.md, "Quarantine"). export
writes only its --to file; import writes one checkpoint under the write lease, or, on bad input,
nothing (docs/checkpoint-format.md, "Other tools"). A stock ``{"model", "optimizer"}`` without a
training's progress is imported as the training of ``--config``/``--set`` (default: the built-in
defaults) would have it at ``--step``: its progress, schedule and counters added, so ``--set
train.resume_from=<its URI>`` resumes from it; one that does not fit that training's model is refused. Exit 2 on bad input (malformed URI, missing
bucket or directory, no checkpoint to verify, a checkpoint that does not verify or is quarantined, a
checkpoint of a newer format version, a folder that is not a DCP checkpoint, an unknown --training).

A store root that holds ``trainings/<time>/`` (what ``relaunch run`` writes) and no checkpoints of its
own is read as its trainings: ``list`` shows each, ``latest`` and ``verify`` read the newest unless
``--training`` names another.
"""

from __future__ import annotations

import argparse
import json

from ...components.core.checkpoint import CheckpointManager, step_key
from ...components.core.checkpoint.interop import export_checkpoint, import_checkpoint
from ...components.core.contract.errors import BadInput, CorruptCheckpoint
from ...components.core.store import FileStore, open_store
from ...components.core.store.training_folders import pick_training, resolve_trainings
from ...components.core.trainer.adopt import training_state
from . import Subcommands


def add_parser(sub: Subcommands, help_text: str) -> None:
    p = sub.add_parser("checkpoints", help=help_text, description=help_text)
    p.add_argument("action", choices=["list", "latest", "verify", *INTEROP])
    p.add_argument("source", nargs="?", help="import: the folder torch.distributed.checkpoint.save wrote")
    p.add_argument("--store", required=True, help="store root: a path, file:///path or s3://bucket/prefix")
    p.add_argument("--step", type=int, help="checkpoint step (verify; default: the latest)")
    p.add_argument("--deep", action="store_true",
                   help="verify: read every byte (formats 2 and 3: every chunk digest; format 1: each file's sha256)")
    p.add_argument("--training", metavar="ID",
                   help="one training of a store root (trainings/<ID>/; default: list all, latest/verify the newest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--uris", action="store_true", help="list: print only the checkpoint URIs, one a line")
    p.add_argument("--to", help="export: the file to write")
    p.add_argument("--config", help="import: the YAML configuration of the training that is to resume from the "
                                    "folder (default: the built-in defaults); a stock {\"model\", \"optimizer\"} "
                                    "gets that training's progress, schedule and counters at --step")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="import: override one field of that configuration, as relaunch run --set (repeatable)")
    p.add_argument("--format", choices=["torch", "safetensors"], default="torch",
                   help="export: one torch.save file of the whole state (default), or the model's weights "
                        "as safetensors")
    p.set_defaults(func=checkpoints)


def checkpoints(args: argparse.Namespace) -> int:
    """Run one ``relaunch checkpoints`` action; returns the exit code."""
    if args.action in INTEROP or args.source is not None:
        return _interop(args)
    targets = _targets(args)
    if args.action == "list":
        listed = []
        for name, uri in targets:
            with CheckpointManager(uri, async_save=False) as mgr:
                listed.append((name, mgr.store.uri, _list_rows(mgr, name)))
        _print_list(listed, args)
        return 0
    name, uri = targets[-1]
    with CheckpointManager(uri, async_save=False) as mgr:
        return _action(mgr, args, name, len(targets))


def _targets(args: argparse.Namespace) -> list[tuple[str | None, str]]:
    """``[(training, store URI), ...]`` the action reads: ``--training``'s, the root's trainings, or the store."""
    store = open_store(args.store)
    if isinstance(store, FileStore) and not store.root.is_dir():  # a typo, not an empty store
        raise BadInput(f"--store {args.store!r}: no such directory; pass the store root (e.g. ./.relaunch/store)")
    if args.training:
        return [(args.training, pick_training(store, args.training))]
    return resolve_trainings(store)


def _list_rows(mgr, training: str | None) -> list[dict]:
    """The ``list`` rows of one store: intact checkpoints and damaged ones, by step."""
    infos = mgr.list()
    pins = mgr.pins()
    rows = [{**i.to_dict(), "status": "ok", "pinned": pins.get(i.step, []),
             "size_bytes": sum(mgr.store.sizes(i.key).values())} for i in infos]
    rows += [_damaged_row(mgr, r, pins) for r in mgr.quarantined()]
    rows.sort(key=lambda r: (r["step"], r["status"] == "ok"))
    return [{**r, "training": training} if training else r for r in rows]


def _action(mgr, args: argparse.Namespace, training: str | None, trainings: int) -> int:
    """``latest`` or ``verify`` on an open manager; returns the exit code."""
    named = {"training": training} if training else {}
    if training and not args.json:
        more = f" (the newest of {trainings}; --training picks another)" if trainings > 1 else ""
        print(f"training {training}{more}")
    if args.action == "latest":
        info = mgr.latest()
        if info is None:
            if args.json:
                print("null")
            else:
                print(f"no committed checkpoint in {mgr.store.uri}")
            return 0
        _print_one({**info.to_dict(), **named}, args.json)
        return 0
    step = args.step
    if step is None:
        latest = mgr.latest()
        if latest is None:
            raise BadInput(f"no committed checkpoint to verify in {mgr.store.uri}")
        step = latest.step
    try:
        info = mgr.verify(step, deep=args.deep)
    except CorruptCheckpoint as err:
        if args.json:
            print(json.dumps({"step": step, "ok": False, "status": "damaged", "error": str(err), **named}))
        raise
    _print_one({**info.to_dict(), "ok": True, "deep": bool(args.deep), **named}, args.json)
    return 0


INTEROP = ("export", "import")


def _interop(args: argparse.Namespace) -> int:
    """``export`` (one checkpoint to a torch.save or safetensors file) and ``import`` (a stock
    ``dcp.save`` folder adopted as a committed checkpoint); returns the exit code."""
    if args.action != "import" and args.source is not None:
        raise BadInput(f"unexpected argument {args.source!r}: only import takes a folder")
    if args.action == "import" and args.source is None:
        raise BadInput("import needs the folder to adopt: relaunch checkpoints import DIR --store URI")
    if args.action == "export" and not args.to:
        raise BadInput("export needs --to FILE (the file to write)")
    # import keeps every checkpoint already there (keep_last=0): adopting one never deletes another
    uri = _targets(args)[-1][1] if args.action == "export" or args.training else args.store
    with CheckpointManager(uri, async_save=False, keep_last=0) as mgr:
        if args.action == "export":
            info = export_checkpoint(mgr, args.to, step=args.step, fmt=args.format)
            done = {"step": info.step, "uri": info.uri, "to": str(args.to), "format": args.format}
            text = f"exported checkpoint {info.uri} to {args.to} ({args.format})"
        else:
            info = import_checkpoint(mgr, args.source, step=args.step, adopt=_adopt(args))
            done = {"step": info.step, "uri": info.uri, "source": str(args.source)}
            text = (f"imported {args.source} as checkpoint {info.uri}; a training resumes from it with "
                    f"--set train.resume_from={info.uri}")
    print(json.dumps(done, sort_keys=True) if args.json else text)
    return 0


def _adopt(args: argparse.Namespace):
    """import: what makes a stock ``{"model", "optimizer"}`` the state a training of ``--config``/``--set``
    resumes from (:func:`relaunch.components.core.trainer.adopt.training_state`)."""
    from ...components.core.contract.config_loading import load_config

    config = load_config(args.config, args.overrides)

    def adopt(state: dict, step: int, source: str):
        return training_state(state, config, step, source)

    return adopt


def _damaged_row(mgr, record: dict, pins: dict) -> dict:
    """A ``list`` row of a quarantined checkpoint (still in place, or moved aside)."""
    step = int(record["step"])
    return {"step": step, "status": "damaged", "reason": record.get("reason", ""),
            "found_at": record.get("found_at", ""), "found_by": record.get("found_by", ""),
            "moved_to": record.get("moved_to"), "recorded": record.get("recorded", True),
            "uri": record.get("moved_to") or mgr.store.uri_for(step_key(step)),
            "epoch": "", "world_size": "", "created_at": "", "metrics": {}, "size_bytes": None,
            "pinned": pins.get(step, []) if record.get("moved_to") is None else []}


def _print_one(row: dict, as_json: bool) -> None:
    """One checkpoint: JSON, or ``field: value`` lines (the URI whole, on its own line)."""
    if as_json:
        print(json.dumps(row, indent=2, sort_keys=True))
        return
    shown = {k: v for k, v in row.items() if k not in ("key", "manifest_sha256", "training")}
    shown["metrics"] = _metrics_text(row.get("metrics") or {}) or "-"
    width = max(len(k) for k in shown)
    for k, v in shown.items():
        print(f"{k:<{width}}  {v}")


def _print_list(listed: list[tuple[str | None, str, list[dict]]], args: argparse.Namespace) -> None:
    """``list``: JSON rows, bare URIs (``--uris``), or a table per training that fits the terminal."""
    rows = [r for _, _, rs in listed for r in rs]
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return
    if args.uris:
        for r in rows:
            print(r["uri"])
        return
    from rich.console import Console

    console = Console()  # rich's own width: the terminal's, 80 columns when piped
    if not any(rs for _, _, rs in listed):
        console.print(f"no checkpoints in {listed[0][1]}" if len(listed) == 1 else
                      f"no checkpoints in the {len(listed)} trainings under {args.store}", highlight=False,
                      soft_wrap=True)
        return
    for name, uri, rs in listed:
        title = f"training {name}: " if name else ""
        # soft_wrap: the URI is never broken by an inserted newline, so a copy of it is whole
        console.print(f"{title}{uri}/checkpoints/  ({len(rs)} checkpoint{'s' if len(rs) != 1 else ''})",
                      highlight=False, soft_wrap=True, markup=False)
        if rs:
            console.print(_table(rs))
    console.print("full URIs: add --uris; every field: --json", highlight=False, soft_wrap=True)


def _table(rows: list[dict]):
    from rich import box
    from rich.table import Table

    metrics = sorted({m for r in rows for m in (r.get("metrics") or {})})
    damaged = any(r["status"] != "ok" for r in rows)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 0), collapse_padding=True)
    columns = [("step", "right"), *([("status", "left")] if damaged else []), ("epoch", "right"),
               ("world", "right"), ("created UTC", "left"), *[(m, "right") for m in metrics], ("size", "right"),
               ("pinned", "left"), *([("reason", "left")] if damaged else [])]
    cells = [[str(r["step"]), *([r["status"]] if damaged else []), str(r.get("epoch", "")),
              str(r.get("world_size", "")), _when(r.get("created_at", "")),
              *[_number((r.get("metrics") or {}).get(m)) for m in metrics],
              human_size(r.get("size_bytes")), ", ".join(r.get("pinned") or []) or "-",
              *([r.get("reason", "") or "-"] if damaged else [])] for r in rows]
    for i, (name, justify) in enumerate(columns):
        if name in ("pinned", "reason"):  # the free text wraps; the figures keep their width
            table.add_column(name, justify=justify, overflow="fold", ratio=1)
        else:
            width = max(len(name), *(len(c[i]) for c in cells))
            table.add_column(name, justify=justify, no_wrap=True, min_width=width)
    for row in cells:
        table.add_row(*row)
    return table


def _number(value) -> str:
    """A metric to 4 significant digits; ``-`` when absent."""
    if value is None or value == "":
        return "-"
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _metrics_text(metrics: dict) -> str:
    return ", ".join(f"{k} {_number(v)}" for k, v in sorted(metrics.items()))


def _when(iso: str) -> str:
    """``2026-12-04T03:05:01+00:00`` -> ``12-04 03:05:01`` (the year is in the training's name)."""
    return iso[5:19].replace("T", " ") if len(iso) >= 19 else (iso or "-")


def human_size(n) -> str:
    """``1536`` -> ``1.5 KiB``; ``-`` when unknown."""
    if not isinstance(n, int):
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
