"""``relaunch run [--config FILE] [--set key=value ...] [--inject-failure SPEC] [--resume]``: the whole
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
:data:`components.core.store.records.TRAINING_IDENTITY`) is refused in one line, exit 2 — run without
``--resume`` to start a new training with it; other keys (logging, checkpoint cadence, evaluation, an
injected failure, the number of nodes: checkpoints reshard) may change. When
that training already reached its end and its pipeline finished, it says so in one line and exits 0
without starting anything; when the training reached its end but evaluate or register failed, it runs
the pipeline again, which launches nothing and evaluates and registers the last checkpoint.

The configuration, its URIs and the task are checked first: bad input fails (exit 2) before anything
starts. The exit code is the failing step's, per the exit-code contract.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from components.core.contract.config import RelaunchConfig, config_from_cli, with_pipeline_parameters


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("run", help=help_text, description=help_text)
    p.add_argument("--config", help="YAML configuration file (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set train.epochs=2 (repeatable)")
    p.add_argument("--inject-failure", metavar="SPEC",
                   help="kill-worker@step=N, preempt@step=N or storage-outage@step=N (a fault-tolerance demo)")
    p.add_argument("--resume", action="store_true",
                   help="continue the newest training of the store, with its own stored configuration, instead "
                        "of starting a new one (a --set that changes what the training is is refused)")
    p.add_argument("--state-dir", default=".relaunch", help="where kfp.local outputs and run logs go")
    p.add_argument("--cold", action="store_true",
                   help="start every step, torchrun agent and worker as a fresh interpreter, as a cluster does "
                        "(slower: by default they are forks of one process that imported kfp, MLflow and torch once)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``relaunch run``; Ctrl-C (SIGINT) or SIGTERM anywhere stops every process it started and ends
    with one line: exit 143 when the training committed a preemption checkpoint, else 130."""
    from pipelines.local.interrupt import STOP_MARGIN_SECONDS, Interrupted, interruptible, stop_descendants

    config = config_from_cli(args.config, None, args.overrides)
    training: list[RelaunchConfig] = []  # the training's configuration, once chosen
    with interruptible():
        try:
            return _run(args, config, training)
        except Interrupted as stop:
            stop_descendants(config.train.preempt_grace_seconds + STOP_MARGIN_SECONDS)  # what is left, if any
            code, line = interrupted(training[-1] if training else None, stop)
            print(line, file=sys.stderr)
            return code


def interrupted(config: RelaunchConfig | None, stop) -> tuple[int, str]:
    """The exit code and the one line of a run stopped by signal: 143 when the training committed a
    checkpoint at the step it stopped at after the signal (its preemption checkpoint), else 130."""
    from components.core.contract.errors import RelaunchError
    from components.core.contract.exitcodes import ExitCode
    from components.core.store import open_store
    from components.core.store.records import read_exit_record, read_summary

    name = "Ctrl-C (SIGINT)" if stop.signum == 2 else "SIGTERM"
    if config is None:
        return ExitCode.INTERRUPTED, f"relaunch: stopped by {name} before a training started"
    resume = "`relaunch run --resume` continues it"
    ended: dict = {}
    summary: dict = {}
    with contextlib.suppress(RelaunchError, OSError, ValueError):  # the store is away: the plain line
        store = open_store(config.store.uri)
        ended, summary = read_exit_record(store) or {}, read_summary(store) or {}
    after = float(ended.get("time") or 0) >= stop.at
    if after and ended.get("exit_code") == ExitCode.PREEMPTED and summary.get("exit_code") == ExitCode.PREEMPTED \
            and summary.get("last_committed_step", -1) == summary.get("last_step") >= 0:
        return ExitCode.PREEMPTED, (f"relaunch: stopped by {name}; checkpoint at step {summary['last_step']} "
                                    f"committed; every process of the run ended; {resume}")
    committed = summary.get("last_committed_step", -1)
    last = f" from its checkpoint at step {committed}" if committed is not None and committed >= 0 else ""
    return ExitCode.INTERRUPTED, f"relaunch: stopped by {name}; every process of the run ended; {resume}{last}"


def _run(args: argparse.Namespace, config: RelaunchConfig, training: list[RelaunchConfig]) -> int:
    from rich.console import Console

    from components.prepare import check_inputs

    if args.inject_failure:  # typed, like the pipeline parameter of the same name
        config = with_pipeline_parameters(config, {"inject_failure": args.inject_failure})
    check_inputs(config)
    console = Console(file=sys.stdout)
    if args.resume:
        config, done, resuming = resume_training(config)
        console.print(done or resuming, highlight=False, soft_wrap=True)
        if done:
            return 0
        if args.inject_failure:  # a demo of the resumed training, not a change of what it is
            config = with_pipeline_parameters(config, {"inject_failure": args.inject_failure})
    else:
        config = new_training(config)
        remember_config(config)
        console.print(f"relaunch: a new training in {config.store.uri} (`relaunch run --resume` continues it)",
                      highlight=False, soft_wrap=True)

    training.append(config)
    from pipelines.local.runner import render_summary, run_pipeline

    result = run_pipeline(config, console=console, state_dir=args.state_dir, cold=args.cold)
    render_summary(config, result, console)
    if result.exit_code:
        print(f"relaunch: error: {result.failed_step} failed (exit {result.exit_code}): {result.message}",
              file=sys.stderr)
    return result.exit_code


def _namespaced(config: RelaunchConfig, training: str) -> RelaunchConfig:
    from components.core.store.trainings import training_uri

    out = config.model_copy(deep=True)
    out.store.uri = training_uri(config.store.uri, training)
    return out


def trainings(config: RelaunchConfig) -> list[str]:
    """The trainings of ``config.store.uri``, oldest first (their names sort by start time)."""
    from components.core.store import open_store
    from components.core.store.trainings import training_names

    return training_names(open_store(config.store.uri))


def new_training(config: RelaunchConfig) -> RelaunchConfig:
    """The configuration of a new training: its own namespace under ``trainings/``, named by its UTC
    start time (a suffix when two start in the same second); nothing is written until prepare runs."""
    existing = set(trainings(config))
    name = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    candidate, n = name, 1
    while candidate in existing:
        n += 1
        candidate = f"{name}-{n}"
    return _namespaced(config, candidate)


def remember_config(config: RelaunchConfig) -> None:
    """Store ``config`` with its training (``runs/config.json``): what ``--resume`` continues with."""
    from components.core.store import open_store
    from components.core.store.records import write_training_config

    write_training_config(open_store(config.store.uri), json.loads(config.to_json()))


ALWAYS_FROM_THE_COMMAND_LINE = ("store.uri", "tracking.run_id", "launch.inject_failure")
"""Keys a resume never takes from the stored configuration: where the trainings are (the store may have
moved), the MLflow run (the training's own, from ``runs/mlflow-run.json``), the failure a demo injects."""


def stored_configuration(config: RelaunchConfig, training: str, store) -> RelaunchConfig:
    """The configuration ``training`` stored, with the keys the command line set explicitly (its
    ``--config`` file and ``--set`` values, as ``config`` holds them) where they do not change what
    the training is; ``config`` in a new namespace when the training stored none.

    Raises:
        BadInput: an explicit key of :data:`~components.core.store.records.TRAINING_IDENTITY` differs
            from the training's; the line names the key, both values and how to start a new training.
    """
    from components.core.contract.errors import BadInput
    from components.core.store.records import identity_changes, read_training_config

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
    if changes:
        key, old, new = changes[0]
        more = f" (and {', '.join(k for k, _, _ in changes[1:])})" if len(changes) > 1 else ""
        raise BadInput(f"--resume: {key} is {json.dumps(old)} in the training {training} and the command line asks "
                       f"for {json.dumps(new)}{more}; a resume continues a training with its own configuration: drop "
                       f"that value, or run without --resume to start a new training with it")
    merged = RelaunchConfig.model_validate(_merge(own, asked))
    return _namespaced(merged.model_copy(update={"store": config.store}), training)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def resume_training(config: RelaunchConfig) -> tuple[RelaunchConfig, str, str]:
    """The configuration that continues the newest training (its stored configuration, its namespace,
    its MLflow run: :func:`stored_configuration`); a line to print instead when there is nothing to do:
    its training reached its end and its pipeline finished ("" otherwise); and the line that says what
    the resume will do.

    Raises:
        BadInput: the store holds no training to resume, or the command line changes what it is.
    """
    from components.core.contract.errors import BadInput
    from components.core.store.records import pipeline_finished, read_summary, stored_run_id
    from components.core.store import open_store
    from components.launch import reached_its_end

    names = trainings(config)
    if not names:
        raise BadInput(f"--resume: {config.store.uri} holds no training to resume; `relaunch run` starts one")
    store = open_store(_namespaced(config, names[-1]).store.uri)
    resumed = stored_configuration(config, names[-1], store)
    summary = read_summary(store)
    ended = reached_its_end(summary)
    if ended and pipeline_finished(store, summary.get("run_id")):
        return resumed, (f"relaunch: the training in {resumed.store.uri} already reached its end (step "
                         f"{summary['last_step']} of {summary['total_steps']}, MLflow run {summary.get('run_id')}); "
                         "nothing to do — `relaunch run` starts a new training"), ""
    if not resumed.tracking.run_id:  # none stored: it never reached prepare's run, which prepare opens
        resumed.tracking.run_id = stored_run_id(store)
    if ended:
        return resumed, "", (f"relaunch: the training in {resumed.store.uri} reached its end (step "
                             f"{summary['last_step']} of {summary['total_steps']}) but its pipeline did not finish; "
                             f"finishing it: evaluate and register its last checkpoint in MLflow run "
                             f"{summary.get('run_id')}, without training")
    from components.core.store.records import read_training_config

    unknown = "" if read_training_config(store) is not None else \
        " (it stored no configuration, from before relaunch kept one: continuing with the command line's)"
    return resumed, "", f"relaunch: resuming the training in {resumed.store.uri}{unknown}"
