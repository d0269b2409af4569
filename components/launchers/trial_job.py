"""A cluster study's trial job, shared by the Katib ``Experiment`` (:mod:`~relaunch.components.launchers.katib`)
and the Trainer ``OptimizationJob`` (:mod:`~relaunch.components.launchers.optimizationjob`): relaunch's own
TrainJob (or PyTorchJob), rendered by :mod:`~relaunch.components.launchers.trainjob` /
:mod:`~relaunch.components.launchers.pytorchjob` from the neutral job spec, so that a trial keeps the
runtime's exit-code failure rules, with what makes it one trial of a study:

- its configuration names the study's trials folder (``<store>/studies/<study>/trials``) as ``store.uri``;
- its container's environment carries the trial's values and its name
  (:mod:`relaunch.components.core.contract.suggestions`: ``KUBEFLOW_TRAINER_OPT_<NAME>``, ``RELAUNCH_TRIAL``),
  which the entrypoint folds in: each trial trains in ``trials/<trial name>/``, its own checkpoints, so a
  restarted pod of it resumes;
- the job's own name, which only the cluster knows (Katib's trial, the OptimizationJob's child TrainJob),
  is a placeholder wherever the rendered job used it (the rendezvous id, a PyTorchJob's master address).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..core.contract.config import RelaunchConfig
from ..core.contract.errors import BadInput
from ..core.contract.suggestions import TRIAL_ENV, check_parameter_names
from ..core.store import join_uri, parse_store_uri
from ..core.trainer.metrics_file import METRICS_FILE_ENV
from ..core.tuning.study_folder import TRIALS, default_storage, study_uri
from . import pytorchjob, trainjob
from .jobs import job_spec

TRAINJOB, PYTORCHJOB = "TrainJob", "PyTorchJob"


def check_study(config: RelaunchConfig, what: str) -> None:
    """Refuse a configuration that is no study before anything is rendered.

    Raises:
        BadInput: an empty ``tune.space``, or a key that cannot be a cluster parameter.
    """
    if not config.tune.space:
        raise BadInput(f"{what}: tune.space is empty: name at least one field to search, e.g. --set "
                       "tune.space.train.lr='{type: log_uniform, low: 0.001, high: 0.3}' (configs/tune.yaml has one)")
    check_parameter_names(config.tune.space)


def study_storage(config: RelaunchConfig) -> str:
    """The Optuna storage URL the steps of a tuning pipeline share (``config`` is the study's, its
    ``store.uri`` the study folder): ``tune.storage``, else the sqlite file in the study folder when
    that is a local folder (one machine, ``kfp.local``).

    Raises:
        BadInput: the store is not a local folder and ``tune.storage`` is unset: pods on other machines
            cannot share a sqlite file.
    """
    if config.tune.storage:
        return config.tune.storage
    scheme, location, _ = parse_store_uri(config.store.uri)
    if scheme != "file":
        raise BadInput(f"tune.storage is unset and store.uri {config.store.uri!r} is not a local folder: the trials of a "
                       "pipeline run in pods of their own and share the Optuna storage in a database; set tune.storage "
                       "to a PostgreSQL URL (e.g. the one behind MLflow), its password from the environment")
    return default_storage(Path(location).absolute())


def trials_config(config: RelaunchConfig) -> RelaunchConfig:
    """What every trial's job carries: ``config`` with ``store.uri`` the study's trials folder (the
    entrypoint adds the trial's name), no MLflow run (each trial opens its own), the study named."""
    trial = config.model_copy(deep=True)
    trial.tune.study = config.study_name
    trial.store.uri = join_uri(study_uri(config.store.uri, config.study_name), TRIALS)
    trial.tracking.run_id = None
    return trial


def job_kind(config: RelaunchConfig) -> str:
    """PyTorchJob when ``launch.backend`` is pytorchjob, else relaunch's TrainJob."""
    return PYTORCHJOB if config.launch.backend == "pytorchjob" else TRAINJOB


def trial_job(config: RelaunchConfig, kind: str, env: list[dict[str, Any]], name: str) -> dict:
    """The job of one trial of ``config``'s study: rendered by the launch backend's own renderer,
    without a name or namespace (the cluster gives them), ``name`` standing for its name wherever the
    job refers to itself, ``env`` added to its training container.

    Args:
        config: the study's configuration (:func:`trials_config` is applied here).
        kind: :data:`TRAINJOB` or :data:`PYTORCHJOB`.
        env: container env entries: the trial's values and name, the metrics file.
        name: what stands for the job's name (``${trialParameters.trialName}``, ``$(RELAUNCH_TRIAL)``).
    """
    study = trials_config(config)
    spec, k8s = job_spec(study), study.launch.kubernetes
    if kind == PYTORCHJOB:
        job = pytorchjob.render_pytorchjob(spec, k8s, pipeline_run_id=config.study_name)
    else:
        job = trainjob.render_trainjob(spec, k8s, study.launch.trainjob, pipeline_run_id=config.study_name)
    rendered_name = job["metadata"].pop("name")
    job["metadata"].pop("namespace", None)
    job = _replace(job, rendered_name, name)
    for container in training_containers(job):
        container["env"] = list(container.get("env") or []) + env
    return job


def training_containers(job: dict) -> list[dict]:
    """The training container(s) of a rendered job: a TrainJob's trainer, each PyTorchJob replica's."""
    if job["kind"] == TRAINJOB:
        return [job["spec"]["trainer"]]
    return [c for replica in job["spec"]["pytorchReplicaSpecs"].values()
            for c in replica["template"]["spec"]["containers"] if c["name"] == pytorchjob.CONTAINER]


def trial_env(values: dict[str, str], trial_name: dict[str, Any], metrics_file: str | None) -> list[dict[str, Any]]:
    """The env entries of a trial: ``RELAUNCH_TRIAL`` (``trial_name``: the rest of its entry, a value or a
    ``valueFrom``) first, so that later entries may refer to it, then each variable of ``values``, then
    ``RELAUNCH_METRICS_FILE`` when the metrics are collected from a file."""
    env = [{"name": TRIAL_ENV, **trial_name}]
    env += [{"name": variable, "value": value} for variable, value in values.items()]
    if metrics_file:
        env.append({"name": METRICS_FILE_ENV, "value": metrics_file})
    return env


def _replace(node: Any, old: str, new: str) -> Any:
    """``node`` with every occurrence of ``old`` in its strings replaced by ``new``."""
    if isinstance(node, dict):
        return {k: _replace(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [_replace(v, old, new) for v in node]
    return node.replace(old, new) if isinstance(node, str) else node


def space_parameters(config: RelaunchConfig, render: Callable[[str, Any], dict]) -> list[dict]:
    """``render(key, parameter)`` of each ``tune.space`` key, in key order (the order the samplers draw in)."""
    return [render(path, config.tune.space[path]) for path in sorted(config.tune.space)]
