"""``relaunch trainings [--store URI] [--json]``: every training of a store with its state, read from the
store's own records (never written to: it works on a read-only store).

    relaunch trainings                           # the trainings of ./.relaunch/store, oldest first
    relaunch trainings --store s3://bucket/relaunch --json

A training's state is one of:

- ``running``: a live process holds its pipeline lock or its checkpoint write lease (its pid and host);
- ``interrupted``: it stopped before its end (Ctrl-C, a kill, a failed attempt) at step N; a resume
  continues from its newest committed checkpoint;
- ``failed``: its last attempt ended with a permanent exit code (bad input, divergence, a bug);
- ``trained``: it reached its last step, but its pipeline did not finish evaluate and register;
- ``finished``: its pipeline went through to its end; registered as version V of its model when
  the tracking server says so (looked up by the training's MLflow run);
- ``prepared``: nothing trained yet (no attempt, no checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
from dataclasses import asdict, dataclass

from ...components.core.checkpoint.layout import (INFLIGHT, LATEST, LEASE, pointed_steps, read_json as read_object,
                                                  read_manifest)
from ...components.core.checkpoint.write_lease import holder_alive as lease_alive
from ...components.core.contract.errors import BadInput
from ...components.core.contract.exitcodes import MEANING, ExitCode, is_retryable
from ...components.core.store import open_store
from ...components.core.store.training_folders import resolve_trainings
from ...components.core.tracking.client import client
from . import Subcommands

REGISTRY_SECONDS = 15.0
"""How long the listing waits for the tracking server to name a finished training's registered version."""


def add_parser(sub: Subcommands, help_text: str) -> None:
    p = sub.add_parser("trainings", help=help_text, description=help_text)
    p.add_argument("--store", help="store root: a path, file:///path or s3://bucket/prefix "
                                   "(default: store.uri of the configuration, ./.relaunch/store)")
    p.add_argument("--config", help="YAML configuration whose store.uri to read (default: the built-in defaults)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--no-registry", action="store_true",
                   help="do not ask the tracking server which model version a finished training registered")
    p.set_defaults(func=trainings)


@dataclass
class TrainingState:
    """One training and where it stands."""

    name: str
    uri: str
    state: str  # running | interrupted | failed | trained | finished | prepared
    detail: str
    step: int  # the newest committed checkpoint's step, -1 when none
    total_steps: int
    run_id: str | None
    registered_version: str | None = None


def trainings(args: argparse.Namespace) -> int:
    """List the trainings of the store with their state; exit 0 (2 when the store holds none)."""
    from ...components.core.contract.config_loading import config_from_cli

    root = args.store or config_from_cli(args.config, None, []).store.uri
    root_store = open_store(root)  # a URI, not a configuration: the root of trainings
    found = resolve_trainings(root_store)
    if found == [(None, root)] and not _holds_a_training(root_store):
        raise BadInput(f"{root} holds no training (trainings/<time>/ or runs/); `relaunch run` starts one")
    stores = {uri: root_store if uri == root else open_store(uri) for _, uri in found}  # each folder once
    states = [training_state(name or uri, uri, stores[uri]) for name, uri in found]
    if not args.no_registry:
        for state in states:
            if state.state == "finished":
                state.registered_version = registered_version(stores[state.uri], state.run_id)
                if state.registered_version:
                    state.detail = f"registered as {state.registered_version}"
    if args.json:
        print(json.dumps([asdict(s) for s in states], indent=2))
        return 0
    width = max(len(s.name) for s in states)
    print(f"{'TRAINING':<{width}}  {'STATE':<11}  {'STEP':>11}  DETAIL")
    for s in states:
        step = f"{s.step}/{s.total_steps}" if s.total_steps else (str(s.step) if s.step >= 0 else "-")
        print(f"{s.name:<{width}}  {s.state:<11}  {step:>11}  {s.detail}")
    return 0


def _holds_a_training(store) -> bool:
    from ...components.core.store.records import read_training_config, stored_run_id

    return bool(store.list("checkpoints/", recursive=False)) or read_training_config(store) is not None \
        or stored_run_id(store) is not None


def training_state(name: str, uri: str, store) -> TrainingState:
    """Where the training at ``uri`` (``store``) stands, from its records alone (reads only)."""
    from ...components.core.store.pipeline_lock import holder_alive as lock_alive
    from ...components.core.store.records import (PIPELINE_LOCK_KEY, pipeline_finished, read_json, read_summary,
                                                  read_training_config, stored_run_id)
    from ...components.core.store.ledger import load_attempts
    from ...components.core.store.ledger import reached_its_end

    step = newest_committed_step(store)
    summary = read_summary(store) or {}
    config = read_training_config(store) or {}
    total = int(summary.get("total_steps") or (config.get("train") or {}).get("max_steps") or 0)
    run_id = stored_run_id(store) or summary.get("run_id")
    out = TrainingState(name=name, uri=uri, state="prepared", detail="nothing trained yet", step=step,
                        total_steps=total, run_id=run_id)
    lock, lease = read_json(store, PIPELINE_LOCK_KEY), read_object(store, LEASE)
    holder = lock if lock_alive(lock) else lease if lease_alive(lease, collect=False) else None
    if holder is not None:
        out.state, out.detail = "running", f"pid {holder.get('pid')} on {holder.get('host')}"
        return out
    if pipeline_finished(store, run_id):
        out.state, out.detail = "finished", "pipeline finished; no registered version"
        return out
    if reached_its_end(summary):
        out.state = "trained"
        out.detail = "trained to its end, not evaluated/registered: `relaunch run --resume` finishes it"
        return out
    attempts = load_attempts(store)
    if not attempts and step < 0:
        return out
    last = attempts[-1] if attempts else None
    code = last.outcome if last is not None else int(ExitCode.KILLED)
    stopped = max(last.last_step if last else -1, step)
    where = f"at step {stopped}" if stopped >= 0 else "before its first step"
    since = f"; resumes from step {step}" if step >= 0 else "; resumes from scratch"
    reason = (summary.get("reason") if summary.get("attempt") == (last.attempt if last else None) else None) \
        or MEANING.get(code, f"exit {code}")
    if is_retryable(code) or code == ExitCode.INTERRUPTED:
        out.state, out.detail = "interrupted", f"{where} (exit {code}: {reason}){since}"
    else:
        out.state, out.detail = "failed", f"{where} (exit {code}: {reason})"
    return out


def newest_committed_step(store) -> int:
    """The step a resume starts from, -1 when none: ``latest.json``'s, or ``inflight.json``'s when that
    step's manifest was committed after the pointer was last advanced (a kill between the two writes)."""
    from ...components.core.contract.errors import CorruptCheckpoint

    newer, pointed = pointed_steps(read_object(store, LATEST), read_object(store, INFLIGHT))
    if newer is not None:
        try:
            read_manifest(store, newer)
            return newer
        except (CorruptCheckpoint, FileNotFoundError):
            pass
    return pointed if pointed is not None else -1


def registered_version(store, run_id: str | None) -> str | None:
    """``<model> version <V>`` registered from the MLflow run ``run_id`` (the newest), or None when none
    is, or the tracking server cannot say (looked up at the tracking URI the training stored)."""
    from ...components.core.store.records import RUN_KEY, read_json

    record = read_json(store, RUN_KEY) or {}
    if not run_id or not record.get("tracking_uri"):
        return None
    found: list[str] = []

    def look_up() -> None:
        with contextlib.suppress(Exception):  # the server is away: the state stands without the version

            versions = client(record["tracking_uri"]).search_model_versions(f"run_id = '{run_id}'")
            if versions:
                newest = max(versions, key=lambda v: int(v.version))
                found.append(f"{newest.name} version {newest.version}")

    asking = threading.Thread(target=look_up, name="relaunch-registry-look-up", daemon=True)
    asking.start()
    asking.join(REGISTRY_SECONDS)
    return found[0] if found else None

