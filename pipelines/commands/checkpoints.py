"""``relaunch checkpoints list|latest|verify --store URI [--step N] [--deep] [--json]``.

    relaunch checkpoints list   --store s3://bucket/exp/run            # every checkpoint: ok or damaged
    relaunch checkpoints latest --store ./.relaunch/store --json       # what a resume would load
    relaunch checkpoints verify --store /shared/exp --step 1200        # manifest, files and sizes
    relaunch checkpoints verify --store /shared/exp --deep             # read and check every byte
    relaunch checkpoints export --store /shared/exp --to model.safetensors --format safetensors
    relaunch checkpoints import ./dcp-folder --store /shared/exp --step 5000 # adopt a dcp.save folder

list, latest and verify never take the write lease and never delete or overwrite a checkpoint; what
they write is a read lease on the step they read (checkpoints/readers/, removed when they end: retention
leaves that step alone meanwhile) and the quarantine marker of a damaged checkpoint they find
(checkpoints/quarantine/, created only if absent; docs/checkpoint-format.md, "Quarantine"). export
writes only its --to file; import writes one checkpoint under the write lease, or, on bad input,
nothing (docs/checkpoint-format.md, "Other tools"). Exit 2 on bad input (malformed URI, missing
bucket or directory, no checkpoint to verify, a checkpoint that does not verify or is quarantined, a
checkpoint of a newer format version, a folder that is not a DCP checkpoint).
"""

from __future__ import annotations

import argparse
import json

from components.core.contract.errors import BadInput, CorruptCheckpoint


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("checkpoints", help=help_text, description=help_text)
    p.add_argument("action", choices=["list", "latest", "verify", *INTEROP])
    p.add_argument("source", nargs="?", help="import: the folder torch.distributed.checkpoint.save wrote")
    p.add_argument("--store", required=True, help="store root: a path, file:///path or s3://bucket/prefix")
    p.add_argument("--step", type=int, help="checkpoint step (verify; default: the latest)")
    p.add_argument("--deep", action="store_true",
                   help="verify: read every byte (formats 2 and 3: every chunk digest; format 1: each file's sha256)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--to", help="export: the file to write")
    p.add_argument("--format", choices=["torch", "safetensors"], default="torch",
                   help="export: one torch.save file of the whole state (default), or the model's weights "
                        "as safetensors")
    p.set_defaults(func=checkpoints)


def checkpoints(args: argparse.Namespace) -> int:
    """Run one ``relaunch checkpoints`` action; returns the exit code."""
    from components.core.checkpoint import CheckpointManager

    from components.core.contract.errors import BadInput
    from components.core.store import FileStore

    if args.action in INTEROP or args.source is not None:
        return _interop(args)
    with CheckpointManager(args.store, async_save=False) as mgr:
        if isinstance(mgr.store, FileStore) and not mgr.store.root.is_dir():  # a typo, not an empty store
            raise BadInput(f"--store {args.store!r}: no such directory; pass the store root (e.g. ./.relaunch/store)")
        return _action(mgr, args)


def _action(mgr, args: argparse.Namespace) -> int:
    """One action on an open manager; returns the exit code."""
    if args.action == "list":
        infos = mgr.list()
        pins = mgr.pins()
        rows = [{**i.to_dict(), "status": "ok", "pinned": pins.get(i.step, [])} for i in infos]
        rows += [_damaged_row(mgr, r, pins) for r in mgr.quarantined()]
        rows.sort(key=lambda r: (r["step"], r["status"] == "ok"))
        _print(rows, args.json, empty=f"no checkpoints in {mgr.store.uri}")
        return 0
    if args.action == "latest":
        info = mgr.latest()
        if info is None:
            if args.json:
                print("null")
            else:
                print(f"no committed checkpoint in {mgr.store.uri}")
            return 0
        _print([info.to_dict()], args.json, single=True)
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
            print(json.dumps({"step": step, "ok": False, "status": "damaged", "error": str(err)}))
        raise
    _print([{**info.to_dict(), "ok": True, "deep": bool(args.deep)}], args.json, single=True)
    return 0


INTEROP = ("export", "import")


def _interop(args: argparse.Namespace) -> int:
    """``export`` (one checkpoint to a torch.save or safetensors file) and ``import`` (a stock
    ``dcp.save`` folder adopted as a committed checkpoint); returns the exit code."""
    from components.core.checkpoint import CheckpointManager
    from components.core.checkpoint.interop import export_checkpoint, import_checkpoint
    from components.core.store import FileStore

    if args.action != "import" and args.source is not None:
        raise BadInput(f"unexpected argument {args.source!r}: only import takes a folder")
    if args.action == "import" and args.source is None:
        raise BadInput("import needs the folder to adopt: relaunch checkpoints import DIR --store URI")
    if args.action == "export" and not args.to:
        raise BadInput("export needs --to FILE (the file to write)")
    # import keeps every checkpoint already there (keep_last=0): adopting one never deletes another
    with CheckpointManager(args.store, async_save=False, keep_last=0) as mgr:
        if args.action == "export":
            if isinstance(mgr.store, FileStore) and not mgr.store.root.is_dir():
                raise BadInput(f"--store {args.store!r}: no such directory; pass the store root")
            info = export_checkpoint(mgr, args.to, step=args.step, fmt=args.format)
            done = {"step": info.step, "uri": info.uri, "to": str(args.to), "format": args.format}
            text = f"exported checkpoint {info.uri} to {args.to} ({args.format})"
        else:
            info = import_checkpoint(mgr, args.source, step=args.step)
            done = {"step": info.step, "uri": info.uri, "source": str(args.source)}
            text = f"imported {args.source} as checkpoint {info.uri}"
    print(json.dumps(done, sort_keys=True) if args.json else text)
    return 0


def _damaged_row(mgr, record: dict, pins: dict) -> dict:
    """A ``list`` row of a quarantined checkpoint (still in place, or moved aside)."""
    from components.core.checkpoint import step_key

    step = int(record["step"])
    return {"step": step, "status": "damaged", "reason": record.get("reason", ""),
            "found_at": record.get("found_at", ""), "found_by": record.get("found_by", ""),
            "moved_to": record.get("moved_to"), "recorded": record.get("recorded", True),
            "uri": record.get("moved_to") or mgr.store.uri_for(step_key(step)),
            "epoch": "", "world_size": "", "created_at": "", "metrics": {},
            "pinned": pins.get(step, []) if record.get("moved_to") is None else []}


def _print(rows: list[dict], as_json: bool, *, single: bool = False, empty: str = "") -> None:
    if as_json:
        print(json.dumps(rows[0] if single else rows, indent=2, sort_keys=True))
        return
    if not rows:
        print(empty)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table()
    columns = ["step"] + [c for c in ("status",) if c in rows[0]] + \
              ["epoch", "world_size", "created_at", "metrics", "uri"] + \
              [c for c in ("pinned", "ok", "reason") if any(c in r for r in rows)]
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*(json.dumps(r.get(c, "")) if isinstance(r.get(c), (dict, list)) else str(r.get(c, ""))
                        for c in columns))
    Console(width=200).print(table)
