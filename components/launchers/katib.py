"""A study on a cluster as a Katib ``Experiment`` (``kubeflow.org/v1beta1``), rendered from the ``tune:`` section.

    relaunch render katib --config configs/tune.yaml --set launch.backend=trainjob -o experiment.yaml

Each trial is relaunch's own training job, rendered by the launch backend's renderer from the neutral job
spec (:mod:`relaunch.components.launchers.trial_job`): a TrainJob on the ``relaunch-torch`` runtime (the pattern
of kubeflow/katib#2560: Katib's defaults for a TrainJob trial, written out) or, with
``launch.backend=pytorchjob``, a PyTorchJob; either keeps the runtime's exit-code failure rules, and trains
in its own folder ``studies/<study>/trials/<trial name>/``, so a restarted pod resumes from its checkpoints.

Katib substitutes the trial's values into ``${trialParameters.<name>}`` placeholders; relaunch puts them
in the training container's environment as ``KUBEFLOW_TRAINER_OPT_<NAME>`` (the variables an
``OptimizationJob`` sets), which the entrypoint folds into the configuration
(:mod:`relaunch.components.core.contract.suggestions`). The metrics: rank 0 appends a line per validation to
``RELAUNCH_METRICS_FILE`` (``step=40 val_loss=0.3412 val_accuracy=0.9133``), the file Katib's File
collector reads with its default filter (``([\\w|-]+)\\s*=\\s*([+-]?\\d*(\\.\\d+)?([Ee][+-]?\\d+)?)``, format
TEXT); the objective is its latest value (the final model's, as ``relaunch tune`` takes it).

The sampler maps to Katib's algorithm of the same name (``tpe`` and ``random``, both Katib's hyperopt
suggestion, seeded by ``random_state``); ``tune.pruner`` has no Katib counterpart here (Katib's median
stopping rule needs its DB-manager's per-step metrics: off).
"""

from __future__ import annotations

from typing import Any

from ..core.contract.config import RelaunchConfig, TuneParameter
from ..core.contract.suggestions import env_name, parameter_name, render_value
from .trial_job import (PYTORCHJOB, TRAINJOB, check_study, job_kind, space_parameters,
                        trial_env, trial_job)
from . import pytorchjob, trainjob

GROUP, VERSION, KIND_NAME = "kubeflow.org", "v1beta1", "Experiment"
METRICS_FILE = "/var/log/katib/metrics.log"
"""Katib's default path of a File collector (``common.DefaultFilePath``); its webhook mounts the folder."""
TRIAL_NAME = "trialName"
"""The trial parameter that stands for the trial's name (Katib's ``${trialSpec.Name}``): its job's name."""
# Katib's defaults for a trial's job (katib pkg/apis/controller/experiments/v1beta1/constants.go), written out
# so that the experiment does not depend on the Katib version filling them in.
CONDITIONS = {
    TRAINJOB: ('status.conditions.#(type=="Complete")#|#(status=="True")#',
               'status.conditions.#(type=="Failed")#|#(status=="True")#'),
    PYTORCHJOB: ('status.conditions.#(type=="Succeeded")#|#(status=="True")#',
                 'status.conditions.#(type=="Failed")#|#(status=="True")#'),
}
PRIMARY_POD_LABELS = {
    # node 0 of the TrainJob's JobSet, and the PyTorchJob's master: the pod whose rank 0 writes the metrics
    TRAINJOB: {"jobset.sigs.k8s.io/replicatedjob-name": trainjob.NODE, "batch.kubernetes.io/job-completion-index": "0"},
    PYTORCHJOB: {"training.kubeflow.org/job-role": "master"},
}
PRIMARY_CONTAINER = {TRAINJOB: trainjob.NODE, PYTORCHJOB: pytorchjob.CONTAINER}


def katib_parameter(path: str, parameter: TuneParameter) -> dict[str, Any]:
    """One ``spec.parameters`` entry: uniform / log_uniform -> ``double`` (``distribution: logUniform``),
    int -> ``int`` (log-spaced likewise), categorical -> ``categorical`` (the choices as text)."""
    if parameter.type == "categorical":
        return {"name": parameter_name(path), "parameterType": "categorical",
                "feasibleSpace": {"list": [render_value(c) for c in parameter.choices]}}
    kind = "int" if parameter.type == "int" else "double"
    low, high = (int(parameter.low), int(parameter.high)) if kind == "int" else (parameter.low, parameter.high)
    space: dict[str, Any] = {"min": render_value(low), "max": render_value(high)}
    if parameter.step is not None:
        space["step"] = render_value(int(parameter.step) if kind == "int" else parameter.step)
    space["distribution"] = "logUniform" if parameter.type == "log_uniform" or parameter.log else "uniform"
    return {"name": parameter_name(path), "parameterType": kind, "feasibleSpace": space}


def build_experiment(config: RelaunchConfig) -> dict:
    """The Katib ``Experiment`` of ``config``'s study (named after it, in ``launch.kubernetes.namespace``).

    Raises:
        BadInput: an empty ``tune.space``, or a key that cannot be a cluster parameter.
    """
    check_study(config, "relaunch render katib")
    tune, kind = config.tune, job_kind(config)
    metric = tune.objective.metric
    extra = sorted({f"val_{config.evaluate.gate_metric}", "step"} - {metric})
    values = {env_name(path): f"${{trialParameters.{parameter_name(path)}}}" for path in sorted(tune.space)}
    env = trial_env(values, {"value": f"${{trialParameters.{TRIAL_NAME}}}"}, METRICS_FILE)
    success, failure = CONDITIONS[kind]
    trial_parameters = [{"name": parameter_name(path), "reference": parameter_name(path),
                         "description": f"tune.space.{path}"} for path in sorted(tune.space)]
    trial_parameters.append({"name": TRIAL_NAME, "reference": "${trialSpec.Name}",
                             "description": "the trial's name: its folder studies/<study>/trials/<name>/"})
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND_NAME,
        "metadata": {"name": config.study_name, "namespace": config.launch.kubernetes.namespace,
                     "labels": {"app.kubernetes.io/name": "relaunch", "app.kubernetes.io/part-of": config.name}},
        "spec": {
            "objective": {"type": tune.objective.direction, "objectiveMetricName": metric,
                          "additionalMetricNames": extra,
                          # the final model's value, as relaunch tune takes it (Katib's default is the best seen)
                          "metricStrategies": [{"name": metric, "value": "latest"}]},
            "algorithm": {"algorithmName": tune.sampler.name,
                          "algorithmSettings": [{"name": "random_state", "value": str(tune.sampler.seed)}]},
            "parallelTrialCount": tune.parallel,
            "maxTrialCount": tune.trials,
            # a failed trial fails itself, not the study (its job restarted it first, by the exit-code rules)
            "maxFailedTrialCount": tune.trials,
            "resumePolicy": "LongRunning",
            "parameters": space_parameters(config, katib_parameter),
            "metricsCollectorSpec": {
                "collector": {"kind": "File"},
                "source": {"fileSystemPath": {"path": METRICS_FILE, "kind": "File", "format": "TEXT"}},
            },
            "trialTemplate": {
                "primaryContainerName": PRIMARY_CONTAINER[kind],
                "primaryPodLabels": PRIMARY_POD_LABELS[kind],
                "successCondition": success,
                "failureCondition": failure,
                "trialParameters": trial_parameters,
                "trialSpec": trial_job(config, kind, env, f"${{trialParameters.{TRIAL_NAME}}}"),
            },
        },
    }


def render(config: RelaunchConfig, run_id: str) -> dict:
    """``relaunch render katib``: the Experiment of the configuration's study (``run_id`` is not used:
    a study is named by ``tune.study``, else the pipeline's name)."""
    return build_experiment(config)
