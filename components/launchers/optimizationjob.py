"""A study on a cluster as a Kubeflow Trainer ``OptimizationJob`` (``trainer.kubeflow.org/v1alpha1``).

    relaunch render optimizationjob --config configs/tune.yaml --set tune.cluster=optimizationjob

The CRD is on the Trainer's main branch after v2.3.0 (kubeflow/trainer#3552), in no release and with no
controller there yet, so it is rendered only behind ``tune.cluster: optimizationjob``. Its controller
starts one TrainJob per trial from ``spec.trainJobTemplate`` and hands it the trial's values as
``KUBEFLOW_TRAINER_OPT_<NAME>`` environment variables (``EnvOptParamPrefix`` + the parameter's name
upper-cased, ``-`` as ``_``), which relaunch's entrypoint folds into the configuration
(:mod:`relaunch.components.core.contract.suggestions`). The template is relaunch's TrainJob
(:mod:`relaunch.components.launchers.trial_job`) on the ``relaunch-torch`` runtime, with the trial's name from
the downward API (the JobSet label that carries the TrainJob's name) as ``RELAUNCH_TRIAL``: each trial trains
in ``studies/<study>/trials/<its TrainJob's name>/``, so a restarted pod resumes from its checkpoints.

What the API cannot say: a TPE sampler (only random and grid search exist; relaunch renders random search
with the seed), a step (a stepped parameter becomes the categorical list of its values, at most 100), a
pruner. The objective is read from the TrainJob's status (KEP-2779), where relaunch's rank 0 reports its
progress.
"""

from __future__ import annotations

from typing import Any

from ..core.contract.config import RelaunchConfig, TuneParameter
from ..core.contract.errors import BadInput
from ..core.contract.suggestions import parameter_name, render_value
from .trial_job import TRAINJOB, check_study, space_parameters, trial_env, trial_job
from .trainjob import GROUP, JOBSET_LABEL, VERSION

KIND_NAME = "OptimizationJob"
MAX_CHOICES = 100
"""The CRD's ``maxItems`` of a categorical parameter's choices (and of numTrials / parallelTrials)."""
TRIAL_NAME_REF = "$(RELAUNCH_TRIAL)"
"""The trial's name in the template's command: Kubernetes expands it from the container's own env."""


def optimization_parameter(path: str, parameter: TuneParameter) -> dict[str, Any]:
    """One ``spec.parameters`` entry: uniform -> ``uniform`` (Float), log_uniform -> ``logUniform``, int ->
    ``uniform`` / ``logUniform`` of type Int, categorical and any stepped parameter -> ``categorical``.

    Raises:
        BadInput: a stepped parameter of more than 100 values, or a choice longer than 64 characters.
    """
    name = parameter_name(path)
    step = parameter.step if parameter.type != "int" or (parameter.step or 1) != 1 else None
    if parameter.type == "categorical" or step is not None:
        choices = parameter.choices if parameter.type == "categorical" else _stepped(path, parameter)
        texts = list(dict.fromkeys(render_value(c) for c in choices))
        if len(texts) > MAX_CHOICES or any(len(t) > 64 for t in texts):
            raise BadInput(f"tune.space.{path}: an OptimizationJob takes at most {MAX_CHOICES} choices of at most 64 "
                           f"characters (this one has {len(texts)}); narrow it or use tune.cluster=katib")
        return {"name": name, "searchSpace": {"categorical": {"choices": texts}}}
    kind = "Int" if parameter.type == "int" else "Float"
    low, high = (int(parameter.low), int(parameter.high)) if kind == "Int" else (parameter.low, parameter.high)
    bounds = {"min": render_value(low), "max": render_value(high), "type": kind}
    log = parameter.type == "log_uniform" or parameter.log
    return {"name": name, "searchSpace": {"logUniform" if log else "uniform": bounds}}


def _stepped(path: str, parameter: TuneParameter) -> list[Any]:
    count = int((parameter.high - parameter.low) / parameter.step + 1e-9) + 1
    if count > MAX_CHOICES:
        raise BadInput(f"tune.space.{path}: an OptimizationJob has no step, so a stepped parameter becomes the list of "
                       f"its values, at most {MAX_CHOICES} (this one has {count}); widen the step or use "
                       "tune.cluster=katib")
    values = [parameter.low + i * parameter.step for i in range(count)]
    return [int(v) for v in values] if parameter.type == "int" else [round(v, 12) for v in values]


def build_optimization_job(config: RelaunchConfig) -> dict:
    """The ``OptimizationJob`` of ``config``'s study.

    Raises:
        BadInput: ``tune.cluster`` is not optimizationjob, the space is empty or does not fit the API, or
            more than 100 trials.
    """
    if config.tune.cluster != "optimizationjob":
        raise BadInput(f"relaunch render optimizationjob: tune.cluster is {config.tune.cluster!r}; the OptimizationJob "
                       "is in no Trainer release yet: --set tune.cluster=optimizationjob renders it (or render katib)")
    check_study(config, "relaunch render optimizationjob")
    tune = config.tune
    if tune.trials > MAX_CHOICES:
        raise BadInput(f"tune.trials={tune.trials}: an OptimizationJob runs at most {MAX_CHOICES} trials; "
                       "lower tune.trials or use tune.cluster=katib")
    # the controller appends the trial's KUBEFLOW_TRAINER_OPT_* values to the trainer's env itself
    env = trial_env({}, {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOBSET_LABEL}']"}}}, None)
    job = trial_job(config, TRAINJOB, env, TRIAL_NAME_REF)
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND_NAME,
        "metadata": {"name": config.study_name, "namespace": config.launch.kubernetes.namespace,
                     "labels": {"app.kubernetes.io/name": "relaunch", "app.kubernetes.io/part-of": config.name}},
        "spec": {
            "objectives": [{"metric": tune.objective.metric, "direction": tune.objective.direction.capitalize()}],
            # random search is the API's only sampler besides grid; seeded as the study is
            "searchAlgorithm": {"random": {"seed": tune.sampler.seed}},
            "parameters": space_parameters(config, optimization_parameter),
            "numTrials": tune.trials,
            "parallelTrials": tune.parallel,
            "trainJobTemplate": {"metadata": {"labels": job["metadata"].get("labels", {})}, "spec": job["spec"]},
        },
    }


def render(config: RelaunchConfig, run_id: str) -> dict:
    """``relaunch render optimizationjob``: the OptimizationJob of the configuration's study (``run_id`` is
    not used: a study is named by ``tune.study``, else the pipeline's name)."""
    return build_optimization_job(config)
