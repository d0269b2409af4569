"""Where a checkpoint lives in the store and what its manifest says (docs/checkpoint-format.md).

Names, the manifest's reading and checking, and the small JSON records (latest, inflight, pins).
No tensor I/O here.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import platform
import re
import threading
from typing import Any, Callable

from ..contract.errors import BadInput, CorruptCheckpoint
from ..store import FileStore, Store

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
PREFIX = "checkpoints"
LATEST = f"{PREFIX}/latest.json"
INFLIGHT = f"{PREFIX}/inflight.json"
LEASE = f"{PREFIX}/LEASE.json"
PINS = f"{PREFIX}/pins"
QUARANTINE = f"{PREFIX}/quarantine"
MANIFEST = "MANIFEST.json"
METADATA = ".metadata"
STEP_DIR = re.compile(r"^step-(\d{12})$")


def step_key(step: int) -> str:
    """``checkpoints/step-<012d>``: the key of a step's directory."""
    if not isinstance(step, int) or step < 0 or step >= 10**12:
        raise BadInput(f"checkpoint step {step!r} must be an integer in [0, 10^12)")
    return f"{PREFIX}/step-{step:012d}"


def parse_checkpoint_uri(uri: str) -> tuple[str, int]:
    """Split ``<root>/checkpoints/step-<012d>[/MANIFEST.json]`` into (store root URI, step).

    Raises:
        BadInput: the URI does not name a checkpoint directory.
    """
    text = str(uri).rstrip("/")
    if text.endswith("/" + MANIFEST):
        text = text[: -len(MANIFEST) - 1]
    root, sep, tail = text.rpartition(f"/{PREFIX}/")
    m = STEP_DIR.match(tail)
    if not sep or not m or not root:
        raise BadInput(f"{uri!r} is not a checkpoint URI; expected <store>/{PREFIX}/step-<12 digits>")
    return root, int(m.group(1))


@dataclasses.dataclass
class CheckpointInfo:
    """A committed checkpoint, as its manifest describes it."""

    step: int
    uri: str
    key: str
    epoch: int
    world_size: int
    created_at: str
    metrics: dict[str, float]
    manifest_sha256: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def info_of(store: Store, step: int, manifest: dict[str, Any]) -> CheckpointInfo:
    return CheckpointInfo(step=step, uri=store.uri_for(step_key(step)), key=step_key(step),
                          epoch=int(manifest.get("epoch", 0)), world_size=int(manifest.get("world_size", 1)),
                          created_at=str(manifest.get("created_at", "")),
                          metrics=dict(manifest.get("metrics") or {}),
                          manifest_sha256=manifest.get("_sha256", ""))


MANIFEST_DIGEST = "manifest_digest"  # the manifest's own digest: "sha256:" + sha256 of the canonical
# body without this field (compact JSON, sorted keys: what manifest_body gives)


def read_manifest_bytes(store: Store, step: int) -> bytes:
    """The raw bytes of ``step``'s ``MANIFEST.json``.

    Raises:
        CorruptCheckpoint: there is none (the step is not committed).
    """
    try:
        return store.read_bytes(f"{step_key(step)}/{MANIFEST}")
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{store.uri_for(step_key(step))} has no {MANIFEST} (not committed)") from None


def read_manifest(store: Store, step: int) -> dict[str, Any]:
    """The parsed ``MANIFEST.json`` of ``step`` with ``_sha256`` (of its bytes) added.

    Raises:
        CorruptCheckpoint: absent (not committed), not JSON, not this step's, malformed, or not
            matching its own ``manifest_digest``.
        BadInput: written by a newer relaunch (an unknown ``format_version``).
    """
    return parse_manifest(store, step, read_manifest_bytes(store, step))


def parse_manifest(store: Store, step: int, raw: bytes) -> dict[str, Any]:
    """``raw`` (the bytes of ``step``'s ``MANIFEST.json``) parsed and checked, with ``_sha256`` added.

    Raises:
        CorruptCheckpoint: not JSON, not this step's, malformed, or not matching its ``manifest_digest``.
        BadInput: written by a newer relaunch (an unknown ``format_version``).
    """
    key = f"{step_key(step)}/{MANIFEST}"
    try:
        manifest = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CorruptCheckpoint(f"{store.uri_for(key)} is not valid JSON") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(f"{store.uri_for(key)} is not a manifest of step {step}")
    version = manifest.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise BadInput(f"{store.uri_for(key)} has checkpoint format_version {version}, written by a newer "
                       f"relaunch; this one reads versions {', '.join(map(str, READABLE_VERSIONS))} (upgrade relaunch)")
    sealed = manifest.get(MANIFEST_DIGEST)
    if sealed is not None or (isinstance(version, int) and version >= 3):
        if sealed != manifest_digest(manifest):
            raise CorruptCheckpoint(f"{store.uri_for(key)} does not match its {MANIFEST_DIGEST} "
                                    f"(edited or damaged after it was committed)")
    if manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpoint(f"{store.uri_for(key)} is not a manifest of step {step}")
    if version not in READABLE_VERSIONS:
        raise CorruptCheckpoint(f"{store.uri_for(key)} has format_version {version!r}; this relaunch reads "
                                f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    for name, meta in manifest["files"].items():
        if "/" in name or name in ("", ".", "..") or not isinstance(meta, dict) \
                or not isinstance(meta.get("size"), int):
            raise CorruptCheckpoint(f"{store.uri_for(key)} names an invalid file {name!r}")
    manifest["_sha256"] = hashlib.sha256(raw).hexdigest()
    return manifest


def manifest_body(manifest: dict[str, Any]) -> bytes:
    """The canonical bytes of a manifest: compact JSON with sorted keys, without ``_`` fields."""
    return json.dumps({k: v for k, v in manifest.items() if not k.startswith("_")}, sort_keys=True,
                      separators=(",", ":")).encode()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical body of ``manifest`` without its ``manifest_digest``."""
    body = manifest_body({k: v for k, v in manifest.items() if k != MANIFEST_DIGEST})
    return "sha256:" + hashlib.sha256(body).hexdigest()


def sealed_manifest_body(manifest: dict[str, Any]) -> bytes:
    """The bytes to commit: ``manifest`` with its ``manifest_digest`` set (the dict is updated too)."""
    manifest[MANIFEST_DIGEST] = manifest_digest(manifest)
    return manifest_body(manifest)


def checkpoint_steps(store: Store) -> list[int]:
    """Step numbers of every ``step-*`` directory in ``store`` (committed or not), ascending."""
    steps = []
    for entry in store.list(PREFIX + "/", recursive=False):
        m = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if m and entry.endswith("/"):
            steps.append(int(m.group(1)))
    return sorted(steps)


def pin_key(step: int, reason: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", reason).strip("-")[:100]
    if not slug:
        raise BadInput(f"pin reason {reason!r} must contain letters or digits")
    return f"{PINS}/step-{step:012d}--{slug}.json"


def parse_pin(key: str) -> tuple[int, str] | None:
    m = re.match(r"^.*/step-(\d{12})--(.+)\.json$", key)
    return (int(m.group(1)), m.group(2)) if m else None


def read_json(store: Store, key: str) -> dict[str, Any] | None:
    """The JSON object at ``key``; None when absent or not a JSON object (a hint that is gone)."""
    try:
        value = json.loads(store.read_bytes(key))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def pointed_steps(latest: dict[str, Any] | None, inflight: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """What ``latest.json`` and ``inflight.json`` point a resume at: ``(newer, pointed)``, inflight's step
    when it is newer than the pointer's (its manifest may have been committed after the pointer was last
    advanced: a kill between the two writes; the caller checks that manifest) and the pointer's step; None
    where there is none."""
    pointed = latest.get("step") if latest else None
    pointed = pointed if isinstance(pointed, int) else None
    newer = inflight.get("step") if inflight else None
    newer = newer if isinstance(newer, int) and (pointed is None or newer > pointed) else None
    return newer, pointed


def at_once(store: Store, *calls: Callable[[], Any]) -> list[Any]:
    """Independent requests to ``store`` made together: one round trip instead of one each on an
    object store (milliseconds a request); one after another on a filesystem, whose requests take
    microseconds and where the threads cost more (~0.45 ms a call here). Each result is the call's
    value, or the Exception it raised, for the caller to raise in its order.

    Plain threads, not an executor: a commit may run from the interpreter's exit hook (a save still
    pending at exit), where an executor refuses new work."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as err:  # noqa: BLE001 - handed back to the caller, who raises it
            results[i] = err

    if len(calls) < 2 or isinstance(store, FileStore):
        for i in range(len(calls)):
            run(i)
        return results
    threads = [threading.Thread(target=run, args=(i,), name="relaunch-request", daemon=True)
               for i in range(1, len(calls))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    return results


def write_conditional(store: Store, key: str, data: bytes, *, if_match: str | None) -> str | None:
    etag = store.write_bytes(key, data, if_match=if_match)
    return etag if isinstance(etag, str) else store.etag(key)


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    import torch

    try:
        from importlib.metadata import version

        relaunch = version("relaunch")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout)
        relaunch = "unknown"
    return {"relaunch": relaunch, "torch": torch.__version__, "python": platform.python_version()}
