"""A study's suggestions: a trial's values applied to a configuration (:func:`apply_suggestions`, for every
trial, local or on a cluster), and a cluster trial's values as the training entrypoint finds them in its
environment.

On a cluster a study's trials are not started by relaunch: Katib (an ``Experiment``) or the Trainer (an
``OptimizationJob``) starts one training job per trial and hands it the trial's values as environment
variables, which :func:`from_environment` folds into the configuration before the training starts:

    KUBEFLOW_TRAINER_OPT_TRAIN__LR=0.0123        the value of tune.space key train.lr
    RELAUNCH_TRIAL=lr-width-trial-3              the trial's name (its job's name): its folder in the study

The variable of a key is the Trainer's rule for an ``OptimizationJob`` parameter, ``KUBEFLOW_TRAINER_OPT_`` +
the parameter's name upper-cased with ``-`` as ``_``; the parameter's name is the key with each ``.`` as
``__`` (:func:`parameter_name`: ``train.lr`` -> ``train__lr``; configuration fields hold no ``__``, so the
mapping goes back by the space's own keys). Katib's ``Experiment`` renders the same variables with its
``${trialParameters...}`` placeholders, so both reach the configuration through this one function.

The configuration the job carries names the study's trials folder as ``store.uri``; the trial's own
folder is that folder's ``<trial name>``, so that every restart of the trial's pods resumes from its own
checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from .config import RelaunchConfig, TuneParameter, describe_validation_error
from .errors import BadInput

OPT_ENV_PREFIX = "KUBEFLOW_TRAINER_OPT_"
"""The Trainer's prefix of an ``OptimizationJob`` trial's parameter variables (``EnvOptParamPrefix``)."""
TRIAL_ENV = "RELAUNCH_TRIAL"
"""The trial's name: its folder under the study's trials folder, and its MLflow run's name."""
SEPARATOR = "__"
"""What a ``.`` of a configuration key becomes in a parameter name (Katib and the Trainer take no dots in env names)."""
_TRIAL_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def parameter_name(path: str) -> str:
    """The cluster parameter name of the ``tune.space`` key ``path``: ``train.lr`` -> ``train__lr``."""
    return path.replace(".", SEPARATOR)


def env_name(path: str) -> str:
    """The variable that carries ``path``'s value: ``KUBEFLOW_TRAINER_OPT_TRAIN__LR``."""
    return OPT_ENV_PREFIX + parameter_name(path).replace("-", "_").upper()


def check_parameter_names(space: Mapping[str, TuneParameter]) -> dict[str, str]:
    """``{parameter name: key}`` of ``space``, refused when two keys would share a name or variable.

    Raises:
        BadInput: a key whose name cannot go back to it (a ``__`` in a task option's name), or one
            longer than the 64 characters a cluster parameter name may have.
    """
    names: dict[str, str] = {}
    variables: dict[str, str] = {}
    for path in space:
        name = parameter_name(path)
        if SEPARATOR in path or len(name) > 64:
            raise BadInput(f"tune.space: key {path!r} cannot be a cluster parameter (its name {name!r} must hold no "
                           f"'{SEPARATOR}' and have at most 64 characters); rename the option")
        other = variables.get(env_name(path))
        if other is not None:
            raise BadInput(f"tune.space: keys {other!r} and {path!r} map to the same variable {env_name(path)}; "
                           "rename one of them")
        names[name], variables[env_name(path)] = path, path
    return names


def render_value(value: Any) -> str:
    """A value as a cluster parameter's text (a categorical choice, a bound): what Katib and the Trainer
    hand back, and what :func:`parse_value` reads."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)


def parse_value(path: str, parameter: TuneParameter, text: str) -> Any:
    """The value of ``path`` that the text ``text`` of its variable says, checked against its parameter.

    Raises:
        BadInput: one line naming the variable, the value and what the parameter allows.
    """
    variable = env_name(path)
    if parameter.type == "categorical":
        for choice in parameter.choices:
            if render_value(choice) == text.strip():
                return choice
        allowed = ", ".join(render_value(c) for c in parameter.choices)
        raise BadInput(f"{variable}={text!r} is not one of tune.space.{path}'s choices ({allowed}); "
                       "the cluster study and the configuration disagree: render it again from this configuration")
    try:
        number = float(text)
    except ValueError:
        raise BadInput(f"{variable}={text!r} is not a number (tune.space.{path} is {parameter.type}); "
                       "render the study again from this configuration") from None
    if not math.isfinite(number) or not parameter.low <= number <= parameter.high:
        raise BadInput(f"{variable}={text!r} is outside tune.space.{path}'s bounds [{parameter.low:g}, "
                       f"{parameter.high:g}]; render the study again from this configuration")
    if parameter.type == "int":
        if not number.is_integer():
            raise BadInput(f"{variable}={text!r} is not a whole number (tune.space.{path} is int); "
                           "render the study again from this configuration")
        return int(number)
    return number


def suggestions(config: RelaunchConfig, environ: Mapping[str, str]) -> dict[str, Any]:
    """``{key: value}`` of every ``KUBEFLOW_TRAINER_OPT_*`` variable in ``environ`` (empty without any).

    Raises:
        BadInput: a variable of no ``tune.space`` key, or a value its parameter refuses.
    """
    given = {name: text for name, text in environ.items() if name.startswith(OPT_ENV_PREFIX)}
    if not given:
        return {}
    space = config.tune.space
    check_parameter_names(space)
    by_variable = {env_name(path): path for path in space}
    unknown = sorted(set(given) - set(by_variable))
    if unknown:
        known = ", ".join(sorted(by_variable)) or "none: tune.space is empty"
        raise BadInput(f"{unknown[0]} names no tune.space key of this configuration (its variables: {known}); "
                       "render the study again from this configuration")
    return {by_variable[name]: parse_value(by_variable[name], space[by_variable[name]], text)
            for name, text in sorted(given.items())}


def apply_suggestions(config: RelaunchConfig, values: dict[str, Any]) -> RelaunchConfig:
    """A copy of ``config`` with each ``dotted.path -> value`` of a trial set and validated by its field.

    Raises:
        BadInput: a value its field refuses (named in one line).
    """
    data = json.loads(config.model_dump_json())
    for path, value in values.items():
        *sections, name = path.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    try:
        return RelaunchConfig.model_validate(data)
    except ValidationError as err:
        raise BadInput(describe_validation_error(err)) from None


def from_environment(config: RelaunchConfig, environ: Mapping[str, str] | None = None) -> RelaunchConfig:
    """``config`` as the trial that ``environ`` describes trains it: the suggested values applied and
    validated, ``store.uri`` the trial's own folder, the MLflow run named after the trial. ``config``
    itself when ``environ`` holds no trial (every training that is not a cluster study's trial).

    Raises:
        BadInput: one line: a suggestion the configuration refuses, a variable of no ``tune.space``
            key, suggestions without the trial's name, or a name that cannot be a folder.
    """
    environ = os.environ if environ is None else environ
    values = suggestions(config, environ)
    trial = environ.get(TRIAL_ENV, "")
    if not values and not trial:
        return config
    if not trial:
        raise BadInput(f"{OPT_ENV_PREFIX}* variables are set but {TRIAL_ENV} is not: a trial needs its name for its "
                       "own folder; render the study with `relaunch render katib|optimizationjob`")
    if not _TRIAL_NAME.match(trial):
        raise BadInput(f"{TRIAL_ENV}={trial!r} is not a Kubernetes object name (a-z, 0-9, '-', at most 63); "
                       "it names the trial's folder")
    tried = apply_suggestions(config, values)
    tried.store.uri = f"{config.store.uri.rstrip('/')}/{trial}"
    tried.tracking.run_id = None
    tried.tracking.run_name = trial
    return tried
