"""The Weights & Biases tracker (:class:`~relaunch.components.core.tracking.trackers.Tracker`), used when
``tracking.wandb`` is set: rank 0's W&B run beside the MLflow run.

What the W&B run holds, kept true across restarts:

- one run per training: its id is derived from the training's MLflow run id (or, without one, the store
  URI), every attempt resumes it (``resume="allow"``);
- the params as the run's config (the world, the code and the versions included), W&B's own system
  metadata and system metrics;
- every metric point at ``step=`` the global step, each step once, none missing: a step is skipped only
  when W&B holds it (an online run's resumed step, or the history of the run's own transaction logs under
  ``WANDB_DIR``, read back). W&B writes its log every 15 s and drops what it had not written when rank 0
  dies (its service stops with its parent), so the tracker keeps the points its log may not hold yet in
  the store at each checkpoint (``runs/wandb-pending.json``); the next attempt logs those of the steps
  up to its resumed checkpoint again and recomputes the rest. Steps neither holds are named on stderr
  and in the summary (``relaunch/wandb_missing_steps``);
- each committed checkpoint as a reference artifact ``checkpoints-<run id>`` (aliases ``latest`` and
  ``step-<n>``, the URI in its metadata: nothing is uploaded), ``checkpoint.latest`` in the summary;
- the attempt's end in the summary; the registered model version through :func:`record_registered_version`.

An outage never stops the training: every W&B call is guarded, an error is one line on stderr and the
tracker goes on (or, when the run cannot be opened at all, stays off for this attempt). Credentials come
only from the environment (``WANDB_API_KEY``, ``WANDB_BASE_URL``); ``WANDB_DIR`` says where run files go.
"""

from __future__ import annotations

import glob
import hashlib
import os
import struct
import sys
from typing import Any, Iterator

from ..contract.errors import BadInput
from ..store import records
from .tracker_protocol import AttemptEnd, AttemptStart, TrackerBase

INIT_TIMEOUT_SECONDS = 60.0  # an unreachable server costs the attempt at most this once, at its start
FINISH_TIMEOUT_SECONDS = 30.0
# W&B's transaction log (``run-<id>.wandb``): a 7-byte header, then LevelDB's log format (32 KiB blocks,
# each record fragment a 7-byte header: CRC32C, little-endian length, type), each record a protobuf
# ``wandb.proto.wandb_internal_pb2.Record`` (W&B's public generated module)
LOG_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
LOG_BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
TAIL_BLOCKS = 4  # how much of an earlier log's end is read first to find its last step


def wandb_run_id(run_id: str | None, store_uri: str) -> str:
    """The W&B run id of a training: the same for every attempt and step (derived from the MLflow run
    id, or the store URI without one): ``rl`` and 22 lowercase hex digits (W&B ids allow no ``/`` or ``:``)."""
    return "rl" + hashlib.sha256((f"run:{run_id}" if run_id else f"store:{store_uri}").encode()).hexdigest()[:22]


def open_tracker(config, store, *, run_id: str | None, attempt: int) -> "WandbTracker | None":
    """The W&B tracker, or None when ``tracking.wandb`` is unset or its mode is ``disabled``."""
    settings = config.tracking.wandb
    if settings is None or settings.mode == "disabled":
        return None
    return WandbTracker(settings, run_id=wandb_run_id(run_id, store.uri if store is not None else ""),
                        attempt=attempt, group=config.name, store=store)


def _init_timeout() -> float:
    try:  # W&B's own variable, which an explicit setting would otherwise override
        return float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_SECONDS))
    except ValueError:
        return INIT_TIMEOUT_SECONDS


def _say(what: str, err: BaseException) -> None:
    print(f"relaunch: wandb: {what}: {type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
          file=sys.stderr, flush=True)


def log_records(data: bytes, base: int = 0) -> Iterator[tuple[Any, int]]:
    """Each whole ``Record`` in ``data`` (bytes of a transaction log from file offset ``base``: 0, a block's
    start or a record's end) and the file offset after it. A record begun before ``data`` is skipped; the
    end of a log still being written (a record not written whole) ends the walk."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    if base == 0:
        if data[:len(LOG_HEADER)] != LOG_HEADER:
            raise ValueError(f"not a W&B transaction log this version reads (header {data[:7]!r})")
        pos = len(LOG_HEADER)
    else:
        pos = 0
    pending: bytes | None = None
    while True:
        left = LOG_BLOCK - (base + pos) % LOG_BLOCK
        if left < 7:  # a block's tail too short for a fragment's header is padding
            pos += left
            continue
        if pos + 7 > len(data):
            return
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        end = pos + 7 + length
        if kind not in (FULL, FIRST, MIDDLE, LAST) or end > len(data):
            return
        chunk, pos = data[pos + 7:end], end
        if kind in (FULL, FIRST):
            pending = chunk
        elif pending is None:
            continue
        else:
            pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(pending)
            except DecodeError:
                return
            pending = None
            yield record, base + pos


def history_step(record) -> int | None:
    """The step of a history record (None for any other record)."""
    return record.history.step.num if record.WhichOneof("record_type") == "history" else None


def last_logged_step(path: str) -> int:
    """The last step a transaction log holds history of (-1: none), read from its end."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            blocks = TAIL_BLOCKS
            while True:
                base = max(0, (size // LOG_BLOCK - blocks + 1) * LOG_BLOCK)
                fh.seek(base)
                steps = [s for record, _ in log_records(fh.read(), base)
                         if (s := history_step(record)) is not None]
                if steps or base == 0:
                    return max(steps, default=-1)
                blocks *= 4
    except (OSError, ValueError) as err:
        _say(f"{path} not read, its steps may be logged again", err)
        return -1


class WandbTracker(TrackerBase):
    """Rank 0's W&B run for one attempt. Every method is a no-op once the run is off."""

    def __init__(self, settings, *, run_id: str, attempt: int, group: str = "relaunch", store=None):
        self.settings, self.id, self.attempt, self.group, self.store = settings, run_id, attempt, group, store
        self.run = None
        self.held = -1  # the last step the W&B run held before this attempt logged
        self.unwritten: list[tuple[int, dict]] = []  # points this attempt's transaction log may not hold yet
        self.log_path = ""  # this attempt's transaction log
        self.log_offset, self.log_step = 0, -1  # how far this attempt's log was read, the last step it holds
        self.errors = 0

    # ---- the attempt's start

    def start(self, start: AttemptStart) -> None:
        """Open (the first attempt) or resume the training's W&B run; off for this attempt when it cannot."""
        try:
            import wandb
        except ImportError:
            raise BadInput("tracking.wandb is set but the wandb package is not installed; "
                           "pip install 'relaunch[wandb]' or unset tracking.wandb") from None
        try:
            self.run = wandb.init(
                project=self.settings.project, entity=self.settings.entity, mode=self.settings.mode,
                id=self.id, resume="allow", group=self.group, job_type="train", reinit="create_new",
                settings=wandb.Settings(console="off", silent=True, init_timeout=_init_timeout(),
                                        finish_timeout=FINISH_TIMEOUT_SECONDS, disable_git=True, save_code=False))
        except Exception as err:  # noqa: BLE001 - W&B is away or refuses: the training goes on without it
            _say("the run could not be opened, W&B is off for this attempt", err)
            self.run = None
            return
        settings = self.run.settings  # W&B hands out a deep copy at each read
        self.log_path = settings.sync_file
        self.held = self._held_step(settings)
        if start.attempt > 0:  # 0: not an attempt, a step adding to the run (record_registered_version)
            self._guard("the attempt's summary", self.run.summary.update,
                        {"relaunch/attempt": start.attempt, "relaunch/resumed_from_step": start.resumed_from,
                         "relaunch/resumed_from": start.resumed_uri or "none", "relaunch/world_size": start.world_size})
            self._log_pending(start.resumed_from)

    def _held_step(self, settings) -> int:
        """The last step the run holds: online, the server's; offline, the history of the run's earlier
        transaction logs under ``WANDB_DIR`` (each attempt writes its own)."""
        if settings.run_mode != "offline-run":
            return (self.run.starting_step or 0) - 1 if self.run.resumed else -1
        own = os.path.abspath(self.log_path)
        pattern = os.path.join(glob.escape(settings.wandb_dir), f"*-{self.id}", f"run-{self.id}.wandb")
        return max((last_logged_step(path) for path in glob.glob(pattern) if os.path.abspath(path) != own),
                   default=-1)

    def _log_pending(self, resumed_from: int) -> None:
        """Log again the points an earlier attempt kept of the steps the run lacks up to ``resumed_from``
        (the steps after it are recomputed); name the steps neither holds."""
        if self.store is None or resumed_from <= self.held:
            return
        try:
            pending = records.read_wandb_pending(self.store, self.id)
        except Exception as err:  # noqa: BLE001 - a store that cannot be read: the steps are named below
            _say("the pending points not read", err)
            pending = None
        missing = [(self.held + 1, resumed_from)]
        if pending is not None:
            for step, metrics in pending["points"]:
                if self.held < step <= resumed_from:
                    self.log_metrics(metrics, step)
            # the record holds every point of (held, through_step]
            missing = [(self.held + 1, min(pending["held"], resumed_from)),
                       (max(pending["through_step"], self.held) + 1, resumed_from)]
        missing = [f"{max(first, 1)}..{last}" for first, last in missing if last >= max(first, 1)]
        if missing:
            steps = ", ".join(missing)
            print(f"relaunch: wandb: steps {steps} are not in the W&B run: neither W&B nor a pending record of an "
                  "earlier attempt holds their points", file=sys.stderr, flush=True)
            self._guard("the missing steps", self.run.summary.update, {"relaunch/wandb_missing_steps": steps})

    def log_params(self, params: dict[str, Any]) -> None:
        """The params as the run's config (a changed value is replaced: the config shows the latest)."""
        if self.run is not None:
            self._guard("params", self.run.config.update, dict(params), allow_val_change=True)

    # ---- during the loop

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """``metrics`` at ``step``; a step the run held when this attempt started is skipped."""
        if self.run is None or step <= self.held:  # this attempt may log one step twice (train, val)
            return
        if self._guard("metrics", self.run.log, dict(metrics), step=step):
            self.unwritten.append((step, dict(metrics)))

    def before_checkpoint(self, step: int) -> None:
        """Keep the points through ``step`` that this attempt's transaction log may not hold yet in the
        store: W&B drops them if rank 0 dies before its next write, and the next attempt, resuming from
        this checkpoint, does not compute them again."""
        if self.run is None or self.store is None:
            return
        self._read_own_log()
        self.unwritten = [(s, m) for s, m in self.unwritten if s > self.log_step]
        self._guard("the pending points", records.write_wandb_pending, self.store, self.id,
                    max(self.held, self.log_step), step, [[s, m] for s, m in self.unwritten if s <= step])

    def _read_own_log(self) -> None:
        """Advance :attr:`log_step` over what this attempt's transaction log holds now."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(self.log_offset)
                for record, end in log_records(fh.read(), self.log_offset):
                    self.log_offset = end
                    step = history_step(record)
                    if step is not None:
                        self.log_step = max(self.log_step, step)
        except (OSError, ValueError) as err:  # unread: every point stays pending
            _say("the run's transaction log not read", err)

    def checkpoint_committed(self, step: int, uri: str, key: str) -> None:
        """A reference artifact of the committed checkpoint (nothing is uploaded) and the summary's latest."""
        if self.run is None:
            return
        import wandb

        def log_reference() -> None:
            artifact = wandb.Artifact(f"checkpoints-{self.id}", type="checkpoint",
                                      metadata={"step": step, "uri": uri, "key": key})
            artifact.add_reference(uri if "://" in uri else "file://" + os.path.abspath(uri),
                                   name=key.rstrip("/").rsplit("/", 1)[-1], checksum=False)
            self.run.log_artifact(artifact, aliases=["latest", f"step-{step}"])

        self._guard("checkpoint reference", log_reference)
        self._guard("checkpoint summary", self.run.summary.update,
                    {"checkpoint.latest": uri, "checkpoint.latest_step": step})

    # ---- the attempt's end

    def end_attempt(self, end: AttemptEnd) -> None:
        """The end in the summary; the goodput figures when the training finished."""
        if self.run is None:
            return
        summary = {"relaunch/end_reason": end.reason[:5000], f"relaunch/attempt.{self.attempt}.exit_code": end.exit_code}
        if end.exit_code == 0:
            summary.update({f"goodput/{k}": v for k, v in end.report.items() if isinstance(v, (int, float))})
        self._guard("the attempt's end", self.run.summary.update, summary)

    def close(self, timeout: float) -> None:
        """Finish this attempt's W&B process (the run itself is resumed by the next attempt); idempotent."""
        run, self.run = self.run, None
        if run is not None:
            import wandb

            self._guard("finishing", run.finish, exit_code=0)
            # stop W&B's service process now: it closes the run's files before this process exits
            self._guard("stopping its service", wandb.teardown)

    # ---- helpers

    def _guard(self, what: str, fn, *args, **kwargs) -> bool:
        try:
            fn(*args, **kwargs)
            return True
        except Exception as err:  # noqa: BLE001 - an outage never stops the training
            self.errors += 1
            _say(f"{what} not logged", err)
            return False


def record_registered_version(config, *, run_id: str | None, store_uri: str, model_name: str, version: str) -> bool:
    """Put the registered model version into the training's W&B run (the register step calls it after
    registering in MLflow). Returns whether it was recorded; never raises (an outage is one line)."""
    settings = config.tracking.wandb
    if settings is None or settings.mode == "disabled":
        return False
    tracker = WandbTracker(settings, run_id=wandb_run_id(run_id, store_uri), attempt=0, group=config.name)
    try:
        tracker.start(AttemptStart(attempt=0, resumed_from=-1, resumed_uri=None, world_size=0))
    except BadInput as err:  # the package is missing: the training's own start said so already
        _say("registered version not recorded", err)
        return False
    if tracker.run is None:
        return False
    done = tracker._guard("registered version", tracker.run.summary.update,
                          {"registry/model": model_name, "registry/version": str(version)})
    tracker.close(FINISH_TIMEOUT_SECONDS)
    return done
