"""The Weights & Biases tracker (:class:`~relaunch.components.core.tracking.trackers.Tracker`), used when
``tracking.wandb`` is set: rank 0's W&B run beside the MLflow run.

What the W&B run holds, kept true across restarts:

- one run per training: its id is derived from the training's MLflow run id (or, without one, the store
  URI), every attempt resumes it (``resume="allow"``);
- the params as the run's config (the world, the code and the versions included), W&B's own system
  metadata and system metrics;
- every metric point at ``step=`` the global step, each step once: an attempt that resumed from an earlier
  checkpoint recomputes steps the run already has and skips them (the last logged step is what W&B
  reports for a resumed online run, or the marker file this tracker keeps beside the offline run files);
- each committed checkpoint as a reference artifact ``checkpoints-<run id>`` (aliases ``latest`` and
  ``step-<n>``, the URI in its metadata: nothing is uploaded), ``checkpoint.latest`` in the summary;
- the attempt's end in the summary; the registered model version through :func:`record_registered_version`.

An outage never stops the training: every W&B call is guarded, an error is one line on stderr and the
tracker goes on (or, when the run cannot be opened at all, stays off for this attempt). Credentials come
only from the environment (``WANDB_API_KEY``, ``WANDB_BASE_URL``); ``WANDB_DIR`` says where run files go.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.tracking.trackers import AttemptEnd, AttemptStart, TrackerBase

INIT_TIMEOUT_SECONDS = 60.0  # an unreachable server costs the attempt at most this once, at its start
FINISH_TIMEOUT_SECONDS = 30.0
MARKER_PREFIX = "relaunch-last-step-"


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
                        attempt=attempt, group=config.name)


def _init_timeout() -> float:
    try:  # W&B's own variable, which an explicit setting would otherwise override
        return float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_SECONDS))
    except ValueError:
        return INIT_TIMEOUT_SECONDS


def _say(what: str, err: BaseException) -> None:
    print(f"relaunch: wandb: {what}: {type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}",
          file=sys.stderr, flush=True)


class WandbTracker(TrackerBase):
    """Rank 0's W&B run for one attempt. Every method is a no-op once the run is off."""

    def __init__(self, settings, *, run_id: str, attempt: int, group: str = "relaunch"):
        self.settings, self.id, self.attempt, self.group = settings, run_id, attempt, group
        self.run = None
        self.last_logged = -1  # the last step the W&B run holds before this attempt logs
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
        # W&B knows the resumed run's next step online; offline only this tracker's marker does
        resumed = (getattr(self.run, "starting_step", 0) or 0) - 1 if self.run.resumed else -1
        self.last_logged = max(resumed, self._read_marker())
        if start.attempt > 0:  # 0: not an attempt, a step adding to the run (record_registered_version)
            self._guard("the attempt's summary", self.run.summary.update,
                        {"relaunch/attempt": start.attempt, "relaunch/resumed_from_step": start.resumed_from,
                         "relaunch/resumed_from": start.resumed_uri or "none", "relaunch/world_size": start.world_size})

    def log_params(self, params: dict[str, Any]) -> None:
        """The params as the run's config (a changed value is replaced: the config shows the latest)."""
        if self.run is not None:
            self._guard("params", self.run.config.update, dict(params), allow_val_change=True)

    # ---- during the loop

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """``metrics`` at ``step``; a step an earlier attempt logged already is skipped."""
        if self.run is None or step <= self.last_logged:  # this attempt may log one step twice (train, val)
            return
        if self._guard("metrics", self.run.log, dict(metrics), step=step):
            self._write_marker(step)

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

    def _marker_path(self) -> str | None:
        try:
            # run.dir is <wandb dir>/<run folder>/files: one marker per training beside the run folders
            return os.path.join(os.path.dirname(os.path.dirname(self.run.dir)), MARKER_PREFIX + self.id)
        except Exception:  # noqa: BLE001 - no run folder (a disabled run): no marker
            return None

    def _read_marker(self) -> int:
        path = self._marker_path()
        try:
            with open(path) as fh:
                return int(json.load(fh)["step"])
        except (OSError, TypeError, ValueError, KeyError):
            return -1

    def _write_marker(self, step: int) -> None:
        path = self._marker_path()
        if path is None:
            return
        try:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as fh:
                json.dump({"step": step}, fh)
            os.replace(tmp, path)
        except OSError as err:
            _say("last-step marker not written", err)


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
