"""``relaunch run [--config FILE] [--set key=value ...] [--inject-failure SPEC] [--resume [--new-run]]``: the whole
pipeline on this machine (kfp.local), with the embedded defaults unless the configuration points elsewhere.

    relaunch run                                      # a new training: 2 torchrun "nodes" on CPU, ./.relaunch/
    relaunch run --inject-failure kill-worker@step=30 # another new training; watch a restart resume
    relaunch run --resume                             # continue the newest training (after Ctrl-C, a crash)
    relaunch run --config configs/local.yaml --set train.epochs=1

Each ``relaunch run`` is a new training: its own store namespace ``<store.uri>/trainings/<UTC time>/``
(its configuration, dataset, checkpoints, attempt records) and its own MLflow run. That is what a user who types the command
again expects after changing a flag, and it keeps every earlier training, its checkpoints and its
registered model intact. ``--resume`` continues the newest training of the store in its MLflow run,
with exactly the configuration that training stored (``runs/config.json``): a ``--set`` or ``--config``
value that would change what the training is (its task, model, data, total steps, optimisation:
:data:`relaunch.components.core.store.records.TRAINING_IDENTITY`) is refused in one line, exit 2 — run without
``--resume`` to start a new training with it; other keys (logging, checkpoint cadence, evaluation, an
injected failure, the number of nodes: checkpoints reshard) may change. When
that training already reached its end and its pipeline finished, it says so in one line and exits 0
without starting anything; when the training reached its end but evaluate or register failed, it runs
the pipeline again, which launches nothing and evaluates and registers the last checkpoint.

One pipeline of a training at a time: each ``relaunch run`` holds its training's pipeline lock
(:mod:`relaunch.components.core.store.pipeline_lock`) from before it writes anything until its pipeline ends;
a ``--resume`` of a training that a live ``relaunch run`` runs is refused in one line naming its pid
and host, exit 2, nothing written. A training whose MLflow run is gone (a lost tracking database)
is refused in one line that prints the command continuing it: ``relaunch run --resume --new-run``,
a new MLflow run tagged with the old run's id (``relaunch.previous_run_id``) and the checkpoint it
continues from.

The configuration, its URIs and the task are checked first: bad input fails (exit 2) before anything
starts. The exit code is the failing step's, per the exit-code contract.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from ...components.core.checkpoint.layout import LATEST, read_json
from ...components.core.contract.config import RelaunchConfig
from ...components.core.contract.config_loading import config_from_cli
from ...components.core.contract.pipeline_parameters import with_pipeline_parameters
from ...components.core.contract.uris import expand_home
from ...components.core.contract.errors import BadInput, RelaunchError
from ...components.core.contract.exitcodes import ExitCode
from ...components.core.store.pipeline_lock import PipelineLock, TrainingInUse
from ...components.core.store.records import (identity_changes, pipeline_finished, read_exit_record, read_summary,
                                              read_training_config, refuse_resume_changes, replace_run,
                                              stored_run_id, write_training_config)
from ...components.core.store.training_folders import training_names, training_uri
from ...components.core.tracking.client import ensure_run, mark_run_finished, run_exists, tracking_uri
from ...components.core.tracking.context import Context
from ...components.core.store.ledger import reached_its_end
from ...components.prepare import check_inputs
from . import Subcommands


def add_parser(sub: Subcommands, help_text: str) -> None:
    p = sub.add_parser("run", help=help_text, description=help_text)
    p.add_argument("--config", help="YAML configuration file (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set train.epochs=2 (repeatable)")
    p.add_argument("--inject-failure", metavar="SPEC",
                   help="kill-worker@step=N, preempt@step=N or storage-outage@step=N (a fault-tolerance demo)")
    p.add_argument("--resume", action="store_true",
                   help="continue the newest training of the store, with its own stored configuration, instead "
                        "of starting a new one (a --set that changes what the training is is refused)")
    p.add_argument("--new-run", action="store_true",
                   help="with --resume: continue the training in a new MLflow run (when its own run is gone: a "
                        "lost tracking database); the new run records the old run's id and the checkpoint it "
                        "resumes from")
    p.add_argument("--state-dir", default=".relaunch", help="where kfp.local outputs and run logs go")
    p.add_argument("--cold", action="store_true",
                   help="start every step, torchrun agent and worker as a fresh interpreter, as a cluster does "
                        "(slower: by default they are forks of one process that imported kfp, MLflow and torch once)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``relaunch run``; Ctrl-C (SIGINT) or SIGTERM anywhere stops every process it started and ends
    with one line: exit 143 when the training committed a preemption checkpoint, else 130."""
    from ..local.interrupt import STOP_MARGIN_SECONDS, Interrupted, interruptible, stop_descendants

    config = config_from_cli(args.config, None, args.overrides)
    training: list[Context] = []  # the training's context, once chosen
    with interruptible():
        try:
            return _run(args, config, training)
        except Interrupted as stop:
            stop_descendants(config.train.preempt_grace_seconds + STOP_MARGIN_SECONDS)  # what is left, if any
            code, line = interrupted(training[-1] if training else None, stop)
            print(line, file=sys.stderr)
            return code


def interrupted(context: Context | None, stop) -> tuple[int, str]:
    """The exit code and the one line of a run stopped by signal, once every process of the run ended
    (so the training's records are final): 143 when the training committed a checkpoint at the step it
    stopped at after the signal (its preemption checkpoint), else 130. The training's MLflow run is
    marked KILLED with the line as its reason (``relaunch.end_reason``) until a resume reopens it."""
    name = "Ctrl-C (SIGINT)" if stop.signum == 2 else "SIGTERM"
    if context is None:
        return ExitCode.INTERRUPTED, f"relaunch: stopped by {name} before a training started"
    resume = "`relaunch run --resume` continues it"
    ended: dict = {}
    summary: dict = {}
    store = None
    with contextlib.suppress(RelaunchError, OSError, ValueError):  # the store is away: the plain line
        store = context.store
        ended, summary = read_exit_record(store) or {}, read_summary(store) or {}
    after = float(ended.get("time") or 0) >= stop.at
    if after and ended.get("exit_code") == ExitCode.PREEMPTED and summary.get("exit_code") == ExitCode.PREEMPTED \
            and summary.get("last_committed_step", -1) == summary.get("last_step") >= 0:
        code, line = ExitCode.PREEMPTED, (f"relaunch: stopped by {name}; checkpoint at step {summary['last_step']} "
                                          f"committed; every process of the run ended; {resume}")
    else:
        committed = summary.get("last_committed_step", -1)
        last = f" from its checkpoint at step {committed}" if committed is not None and committed >= 0 else ""
        code, line = ExitCode.INTERRUPTED, f"relaunch: stopped by {name}; every process of the run ended; {resume}{last}"
    if store is not None:
        _mark_interrupted(context.config, store, summary, line.removeprefix("relaunch: "))
    return code, line


MARK_SECONDS = 20.0
"""How long an interrupted run waits for the tracking server to take the KILLED status."""


def _mark_interrupted(config: RelaunchConfig, store, summary: dict, reason: str) -> None:
    """Mark the training's MLflow run KILLED with ``reason`` (unless its pipeline had finished), within
    :data:`MARK_SECONDS`; a server that does not answer in time leaves it as it was."""
    import threading

    with contextlib.suppress(RelaunchError, OSError, ValueError):
        run_id = config.tracking.run_id or summary.get("run_id") or stored_run_id(store)
        if not run_id or pipeline_finished(store, run_id):
            return

        def mark() -> None:
            with contextlib.suppress(Exception):  # the line is printed whatever the server says
                mark_run_finished(config, run_id, "KILLED", f"interrupted: {reason}")

        marking = threading.Thread(target=mark, name="relaunch-mark-interrupted", daemon=True)
        marking.start()
        marking.join(MARK_SECONDS)


def _run(args: argparse.Namespace, config: RelaunchConfig, training: list[Context]) -> int:
    from rich.console import Console

    from ..local.interrupt import Interrupted

    if args.inject_failure:  # typed, like the pipeline parameter of the same name
        config = with_pipeline_parameters(config, {"inject_failure": args.inject_failure})
    if args.new_run and not args.resume:
        raise BadInput("--new-run goes with --resume (a new training always gets a new MLflow run)")
    check_inputs(config)
    state_dir = _state_dir(args.state_dir)
    console = Console(file=sys.stdout)
    with contextlib.ExitStack() as held:  # the training's pipeline lock, released when its pipeline ends
        try:
            result = _run_pipeline(args, config, training, held, console, state_dir)
        except Interrupted:
            # kept until this process exits (then its pid is gone: stale): run() still stops what the
            # pipeline started and marks its MLflow run, and no resume may start beside that
            held.pop_all()
            raise
        if result is None:
            return 0
    if result.exit_code:
        print(f"relaunch: error: {result.failed_step} failed (exit {result.exit_code}): {result.message}",
              file=sys.stderr)
    return result.exit_code


def _run_pipeline(args: argparse.Namespace, config: RelaunchConfig, training: list[Context],
                  held: contextlib.ExitStack, console, state_dir: str):
    """Choose the training (its pipeline lock into ``held``), say so, run its pipeline; its result, or
    None when a resume had nothing to do. One context for the root of trainings, one for the training."""
    root = Context(config)
    if args.resume:
        context, done, resuming = _resume_training(root, held)
        if done:
            console.print(done, highlight=False, soft_wrap=True)
            return None
        context = training_run(context, new_run=args.new_run)
        console.print(resuming, highlight=False, soft_wrap=True)
        if args.inject_failure:  # a demo of the resumed training, not a change of what it is
            context = context.for_config(with_pipeline_parameters(context.config, {"inject_failure": args.inject_failure}))
    else:
        context = _new_training(root, held)
        _remember_config(context)
        console.print(f"relaunch: a new training in {context.config.store.uri} (`relaunch run --resume` continues it)",
                      highlight=False, soft_wrap=True)

    training.append(context)
    from ..local.runner import render_summary, run_pipeline

    result = run_pipeline(context.config, console=console, state_dir=state_dir, cold=args.cold, context=context)
    render_summary(context.config, result, console, context=context)
    return result


def _state_dir(path: str) -> str:
    """``--state-dir`` with a leading ``~`` expanded (never a folder named ``~``)."""
    try:
        return expand_home(path)
    except ValueError as err:
        raise BadInput(f"--state-dir {err}") from None


def _namespaced(config: RelaunchConfig, training: str) -> RelaunchConfig:
    out = config.model_copy(deep=True)
    out.store.uri = training_uri(config.store.uri, training)
    return out


def trainings(config: RelaunchConfig) -> list[str]:
    """The trainings of ``config.store.uri``, oldest first (their names sort by start time)."""
    return training_names(Context(config).store)


def new_training(config: RelaunchConfig, held: contextlib.ExitStack | None = None) -> RelaunchConfig:
    """The configuration of a new training: its own namespace under ``trainings/``, named by its UTC
    start time (a suffix when two start in the same second). With ``held``, its pipeline lock is taken
    into it: the first thing written (two runs started in the same second get two names); without,
    nothing is written until prepare runs."""
    return _new_training(Context(config), held).config


def _new_training(root: Context, held: contextlib.ExitStack | None = None) -> Context:
    """:func:`new_training` from the context of the root of trainings; the new training's context."""
    existing = set(training_names(root.store))
    name = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    candidate, n = name, 1
    while True:
        if candidate not in existing:
            namespaced = Context(_namespaced(root.config, candidate))
            if held is None:
                return namespaced
            try:
                held.enter_context(_pipeline_lock(namespaced, candidate))
                return namespaced
            except TrainingInUse:
                pass  # another new training took this name a moment ago
        n += 1
        candidate = f"{name}-{n}"


def _pipeline_lock(context: Context, training: str):
    """The pipeline lock of ``training`` (``context`` its namespace's), taken.

    Raises:
        TrainingInUse: a live ``relaunch run`` holds it (one line naming its pid and host, exit 2).
    """
    return PipelineLock(context.store, training).take()


def remember_config(config: RelaunchConfig) -> None:
    """Store ``config`` with its training (``runs/config.json``): what ``--resume`` continues with."""
    _remember_config(Context(config))


def _remember_config(context: Context) -> None:
    write_training_config(context.store, json.loads(context.config.to_json()))


ALWAYS_FROM_THE_COMMAND_LINE = ("store.uri", "tracking.run_id", "launch.inject_failure")
"""Keys a resume never takes from the stored configuration: where the trainings are (the store may have
moved), the MLflow run (the training's own, from ``runs/mlflow-run.json``), the failure a demo injects."""


def stored_configuration(config: RelaunchConfig, training: str, store) -> RelaunchConfig:
    """The configuration ``training`` stored, with the keys the command line set explicitly (its
    ``--config`` file and ``--set`` values, as ``config`` holds them) where they do not change what
    the training is; ``config`` in a new namespace when the training stored none.

    Raises:
        BadInput: an explicit key of :data:`~relaunch.components.core.store.records.TRAINING_IDENTITY` differs
            from the training's; the line names the key, both values and how to start a new training.
    """
    stored = read_training_config(store)
    if stored is None:  # a training from before relaunch stored its configuration
        return _namespaced(config, training)
    own = json.loads(RelaunchConfig.model_validate(stored).to_json())  # the stored one, normalised
    asked = config.model_dump(mode="json", exclude_unset=True)
    for key in ALWAYS_FROM_THE_COMMAND_LINE:
        section, name = key.split(".")
        asked.get(section, {}).pop(name, None)
        own[section][name] = None if key != "store.uri" else own[section][name]
    changes = identity_changes(own, asked)
    refuse_resume_changes(changes, f"the training {training}", "a resume continues a training with its own "
                          "configuration: drop that value, or run without --resume to start a new training with it")
    merged = RelaunchConfig.model_validate(_merge(own, asked))
    return _namespaced(merged.model_copy(update={"store": config.store}), training)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def resume_training(config: RelaunchConfig,
                    held: contextlib.ExitStack | None = None) -> tuple[RelaunchConfig, str, str]:
    """The configuration that continues the newest training (its stored configuration, its namespace,
    its MLflow run: :func:`stored_configuration`); a line to print instead when there is nothing to do:
    its training reached its end and its pipeline finished ("" otherwise); and the line that says what
    the resume will do. With ``held``, the training's pipeline lock is taken into it before anything
    is decided (without: the choice alone, nothing written).

    Raises:
        BadInput: the store holds no training to resume, or the command line changes what it is.
        TrainingInUse: a live ``relaunch run`` runs a pipeline of it (the line names its pid and host).
    """
    context, done, line = _resume_training(Context(config), held)
    return context.config, done, line


def _resume_training(root: Context, held: contextlib.ExitStack | None = None) -> tuple[Context, str, str]:
    """:func:`resume_training` from the context of the root of trainings; the resumed training's context."""
    config = root.config
    names = training_names(root.store)
    if not names:
        raise BadInput(f"--resume: {config.store.uri} holds no training to resume; `relaunch run` starts one")
    newest = Context(_namespaced(config, names[-1]))
    store = newest.store
    resumed = stored_configuration(config, names[-1], store)
    context = newest.for_config(resumed)  # the same folder: the same store
    if held is not None:
        held.enter_context(_pipeline_lock(context, names[-1]))
    summary = read_summary(store)
    ended = reached_its_end(summary)
    if ended and pipeline_finished(store, summary.get("run_id")):
        return context, (f"relaunch: the training in {resumed.store.uri} already reached its end (step "
                         f"{summary['last_step']} of {summary['total_steps']}, MLflow run {summary.get('run_id')}); "
                         "nothing to do — `relaunch run` starts a new training"), ""
    if not resumed.tracking.run_id:  # none stored: it never reached prepare's run, which prepare opens
        resumed.tracking.run_id = stored_run_id(store)
    if ended:
        return context, "", (f"relaunch: the training in {resumed.store.uri} reached its end (step "
                             f"{summary['last_step']} of {summary['total_steps']}) but its pipeline did not finish; "
                             f"finishing it: evaluate and register its last checkpoint in MLflow run "
                             f"{summary.get('run_id')}, without training")

    unknown = "" if read_training_config(store) is not None else \
        " (it stored no configuration, from before relaunch kept one: continuing with the command line's)"
    return context, "", f"relaunch: resuming the training in {resumed.store.uri}{unknown}"


def training_run(context: Context, *, new_run: bool = False) -> Context:
    """``context`` (a resumed training's) checked against its MLflow run: unchanged when the run exists
    (or none was opened yet); with ``new_run``, in a new MLflow run when its own is gone
    (:func:`continue_in_a_new_run`).

    Raises:
        BadInput: its MLflow run does not exist at the tracking URI (the line prints the command that
            continues the training: this one with ``--new-run``), or ``new_run`` when it does or when
            the training has none yet.
    """
    config = context.config
    run_id, training = config.tracking.run_id, config.store.uri.rstrip("/").rsplit("/", 1)[-1]
    if not run_id:
        if new_run:
            raise BadInput("--new-run: the training has no MLflow run yet (its first pipeline opens one); "
                           "drop --new-run")
        return context
    if run_exists(config, run_id):
        if new_run:
            raise BadInput(f"--new-run: the training's MLflow run {run_id} exists at {tracking_uri(config)}; "
                           f"drop --new-run to continue in it")
        return context
    if not new_run:
        raise BadInput(f"--resume: the MLflow run {run_id} of the training {training} does not exist at "
                       f"{tracking_uri(config)} (its tracking database was lost or the run deleted); its "
                       f"checkpoints are intact: `{_new_run_command()}` continues it in a new MLflow run "
                       f"that records the old one")
    out = config.model_copy(deep=True)
    out.tracking.run_id = continue_in_a_new_run(config, context.store, training)
    return context.for_config(out)


def _new_run_command() -> str:
    """This very command line with ``--new-run`` added: the way out printed for a lost MLflow run."""
    import shlex

    argv = [a for a in sys.argv[1:] if a != "--new-run"]
    return shlex.join(["relaunch", *argv, "--new-run"])


def continue_in_a_new_run(config: RelaunchConfig, store, training: str) -> str:
    """Open a new MLflow run for the training in ``store`` whose own run is gone, tagged with the old
    run's id and the checkpoint the training continues from, and store it as the training's run
    (``runs/mlflow-run.json``, the old id kept in its record); its id."""
    old = config.tracking.run_id
    fresh = config.model_copy(deep=True)
    fresh.tracking.run_id = None
    latest = read_json(store, LATEST) or {}
    run_id = ensure_run(fresh, tags={"relaunch.previous_run_id": old, "relaunch.training": training,
                                     "relaunch.store_uri": config.store.uri,
                                     "relaunch.resumed_from_checkpoint":
                                         store.uri_for(latest["path"]) if latest.get("path") else ""})
    replace_run(store, run_id, tracking_uri=tracking_uri(config), experiment=config.tracking.experiment)
    print(f"relaunch: the MLflow run {old} is gone; the training continues in the new MLflow run {run_id} "
          f"(tag relaunch.previous_run_id={old})", file=sys.stderr, flush=True)
    return run_id
