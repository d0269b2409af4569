"""Kubeflow Pipelines on a cluster: the KFP pipeline (:mod:`relaunch.pipelines.kfp_pipeline`) with the
kfp-kubernetes settings a cluster needs, and the ``kfp.Client`` calls that submit it.

    relaunch compile --target kfp --config cluster.yaml -o pipeline.kfp.yaml
    relaunch submit --target kfp --config cluster.yaml            # KF_PIPELINES_ENDPOINT, KF_PIPELINES_TOKEN
    relaunch schedule --target kfp --cron '0 3 * * *' --config cluster.yaml

Every executor gets the store and tracking credentials as env from Secrets (``kfp.kubernetes.
use_secret_as_env``: the pipeline carries Secret *names*, never values) and ``AWS_ENDPOINT_URL``;
the service account is a property of a run, so it is passed at submission.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..components.core.contract.config import RelaunchConfig
from ..components.core.contract.errors import BadInput
from ..components.launchers.jobs import secret_env_sources, store_secret_files


def secret_env_config(config: RelaunchConfig) -> dict:
    """The kfp-kubernetes executor config (PlatformSpec JSON) mapping the Secrets to env vars.

    Produced by ``kfp.kubernetes.use_secret_as_env`` itself on a probe task, so the JSON is what
    kfp-kubernetes emits, not a copy of its format.
    """
    from kfp import compiler, dsl, kubernetes

    k8s = config.launch.kubernetes

    @dsl.container_component
    def probe():
        return dsl.ContainerSpec(image=k8s.image, command=["true"])

    @dsl.pipeline(name="probe")
    def probe_pipeline():
        task = probe()
        for secret, keys, optional in secret_env_sources(k8s, config.store.uri):
            kubernetes.use_secret_as_env(task, secret_name=secret, optional=optional,
                                         secret_key_to_env={key: key for key in keys})
        for file in store_secret_files(k8s, config.store.uri):
            kubernetes.use_secret_as_volume(task, secret_name=file.secret, mount_path=file.mount_dir)
        kubernetes.set_image_pull_policy(task, k8s.image_pull_policy)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.yaml"
        compiler.Compiler().compile(probe_pipeline, str(path))
        docs = list(yaml.safe_load_all(path.read_text()))
    return docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-probe"]


def compile_for_cluster(path: str | Path, config: RelaunchConfig | None = None) -> None:
    """Compile the KFP pipeline to ``path`` with secrets-as-env and the store endpoint on every executor."""
    from .kfp_pipeline import compile_pipeline, to_yaml

    config = config or RelaunchConfig()
    k8s = config.launch.kubernetes
    compile_pipeline(str(path), config)
    docs = list(yaml.safe_load_all(Path(path).read_text()))
    pipeline = docs[0]
    platform = docs[1] if len(docs) > 1 else {"platforms": {"kubernetes": {"deploymentSpec": {"executors": {}}}}}
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"].setdefault("executors", {})
    settings = secret_env_config(config)
    for name, executor in pipeline["deploymentSpec"]["executors"].items():
        merged = executors.setdefault(name, {})
        for key, value in settings.items():
            merged[key] = merged.get(key, []) + value if isinstance(value, list) else value
        if k8s.store_endpoint:
            env = executor["container"].setdefault("env", [])
            env.append({"name": "AWS_ENDPOINT_URL", "value": k8s.store_endpoint})
        for file in store_secret_files(k8s, config.store.uri):
            executor["container"].setdefault("env", []).append({"name": file.env, "value": file.path})
    Path(path).write_text(to_yaml([pipeline, platform]))


# --------------------------------------------------------------------------- kfp.Client calls


def client(host: str | None = None, namespace: str | None = None):
    """``kfp.Client`` from arguments or the usual environment: ``KF_PIPELINES_ENDPOINT``, and a bearer
    token in ``KF_PIPELINES_TOKEN`` (or kfp's own kubeconfig / in-cluster credentials)."""
    import kfp

    token = os.environ.get("KF_PIPELINES_TOKEN") or None
    return kfp.Client(host=host or os.environ.get("KF_PIPELINES_ENDPOINT"), namespace=namespace or "kubeflow",
                      existing_token=token)


def typed_arguments(package: str | Path, arguments: dict[str, str] | None) -> dict:
    """``--param NAME=VALUE`` strings as the types the pipeline declares (the API server refuses a
    string for an integer input); an unknown name or a value of the wrong type is bad input."""
    declared = next(yaml.safe_load_all(Path(package).read_text()))["root"]["inputDefinitions"]["parameters"]
    typed: dict = {}
    for name, raw in (arguments or {}).items():
        if name not in declared:
            raise BadInput(f"--param {name}: no such pipeline parameter; known: {', '.join(declared)}")
        kind = declared[name]["parameterType"]
        try:
            if kind == "STRING":
                typed[name] = raw
            elif kind == "NUMBER_INTEGER":
                typed[name] = int(raw)
            elif kind == "NUMBER_DOUBLE":
                typed[name] = float(raw)
            else:  # BOOLEAN, STRUCT, LIST: YAML, like --set
                typed[name] = yaml.safe_load(raw)
        except (ValueError, yaml.YAMLError):
            raise BadInput(f"--param {name}={raw!r}: expected {kind}") from None
    return typed


@dataclass
class Submitted:
    run_id: str
    url: str = ""


def submit(kfp_client, package: str | Path, config: RelaunchConfig, *, run_name: str | None = None,
           experiment: str | None = None, arguments: dict | None = None) -> Submitted:
    """One run of the compiled package, as the pipeline's service account."""
    result = kfp_client.create_run_from_pipeline_package(
        str(package), arguments=typed_arguments(package, arguments), run_name=run_name, experiment_name=experiment or config.name,
        enable_caching=False, service_account=config.launch.kubernetes.service_account)
    return Submitted(run_id=result.run_id)


def upload(kfp_client, package: str | Path, *, name: str, version: str) -> tuple[str, str]:
    """Upload the package as pipeline ``name`` (created on first use) and a new version of it.

    Returns ``(pipeline_id, version_id)``.
    """
    pipeline_id = kfp_client.get_pipeline_id(name)
    if pipeline_id is None:
        pipeline_id = kfp_client.upload_pipeline(str(package), pipeline_name=name).pipeline_id
    created = kfp_client.upload_pipeline_version(str(package), pipeline_version_name=version, pipeline_id=pipeline_id)
    return pipeline_id, created.pipeline_version_id


def schedule(kfp_client, package: str | Path, config: RelaunchConfig, *, cron: str, version: str,
             experiment: str | None = None, arguments: dict | None = None) -> str:
    """A recurring run of a new pipeline version: one at a time, no catch-up of missed runs.

    ``cron`` is KFP's six-field form (seconds first); a five-field expression gets ``0`` seconds.
    Returns the recurring run's id.
    """
    params = typed_arguments(package, arguments)  # refused before anything is uploaded
    fields = cron.split()
    if len(fields) == 5:
        cron = f"0 {cron}"
    pipeline_id, version_id = upload(kfp_client, package, name=config.name, version=version)
    experiment_id = kfp_client.create_experiment(experiment or config.name).experiment_id
    recurring = kfp_client.create_recurring_run(
        experiment_id=experiment_id, job_name=f"{config.name}-recurring", cron_expression=cron,
        max_concurrency=1, no_catchup=True, params=params, pipeline_id=pipeline_id,
        version_id=version_id, enable_caching=False, service_account=config.launch.kubernetes.service_account)
    return recurring.recurring_run_id
