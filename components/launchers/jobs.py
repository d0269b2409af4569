"""What a training job is made of and how its end is read; pure functions (no API calls).

:func:`job_spec` builds the one neutral description of a training job from the configuration, as
TorchX's ``components/dist.py`` returns an ``AppDef``: a :class:`JobSpec` (image, the torchrun
command, env, Secrets as env, resources, nodes, processes per node, restart policy). Each launcher
renders that spec, never the configuration: :mod:`~relaunch.components.launchers.local` (torchrun agents on
this machine), :mod:`~relaunch.components.launchers.pytorchjob`, :mod:`~relaunch.components.launchers.trainjob` and
:mod:`~relaunch.components.launchers.slurm`; the cluster ones add only their backend's own settings
(namespace, service account, placement, job-level limits from ``launch.kubernetes`` and
``launch.trainjob``). The Argo and KFP definitions read the same Secrets and plain environment
from here, and the mapping of a failed job's conditions and pods to the exit-code contract is here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..core.contract.steps import LAUNCH
from ..core.contract.config import RelaunchConfig
from ..core.contract.classify import classify_pod
from ..core.contract.exitcodes import PERMANENT, RETRYABLE, ExitCode
from ..core.runtime.zygote import CLIENT_PATH, client_command
from .k8s_naming import job_name, run_hash

RUN_LABEL = "relaunch.dev/pipeline-run"
RUN_ANNOTATION = "relaunch.dev/pipeline-run-id"
STEP = LAUNCH  # the step whose pipeline-run-scoped job this is
TRAIN_MODULE = "relaunch.components.train"

# The Secrets every relaunch container reads, and the keys (each key equals the variable's name).
STORE_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# az:// stores: the Secret holds one of the forms the Azure SDK reads (a connection string, an account
# with its key, or an account with a SAS token), so each key is optional.
AZURE_SECRET_KEYS = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY",
                     "AZURE_STORAGE_SAS_TOKEN")
STORE_SECRETS_BY_SCHEME = {"az": (AZURE_SECRET_KEYS, True)}
"""``(keys, optional)`` of the store Secret by store URI scheme; any other scheme reads STORE_SECRET_KEYS."""
TRACKING_SECRET_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
STUDY_SECRET_KEYS = ("PGPASSWORD",)
"""The password of ``tune.storage``'s PostgreSQL, which libpq reads when the URL carries none."""
# A gs:// store's credentials: the store Secret's key file, mounted read-only, named by the variable
# Google's client libraries read (an empty launch.kubernetes.store_secret: workload identity instead).
GCS_KEY_DIR = "/var/run/secrets/relaunch/store"
GCS_KEY_FILE = "key.json"

# Environment the Argo launch step sets so the job is garbage-collected with its workflow.
OWNER_ENV = {
    "apiVersion": "RELAUNCH_OWNER_API_VERSION",
    "kind": "RELAUNCH_OWNER_KIND",
    "name": "RELAUNCH_OWNER_NAME",
    "uid": "RELAUNCH_OWNER_UID",
}

# Container waiting reasons that no amount of waiting fixes.
UNSTARTABLE_REASONS = frozenset({"InvalidImageName", "CreateContainerConfigError", "CreateContainerError"})


# --------------------------------------------------------------------------- the neutral job spec


@dataclass(frozen=True)
class SecretEnv:
    """Environment variables read from a Secret; each key is the variable's name."""

    secret: str
    keys: tuple[str, ...]
    optional: bool = False


@dataclass(frozen=True)
class SecretFile:
    """A Secret's key mounted as a read-only file; ``env`` names the variable that gets its path."""

    secret: str
    key: str
    mount_dir: str
    env: str

    @property
    def path(self) -> str:
        return f"{self.mount_dir}/{self.key}"


@dataclass(frozen=True)
class Resources:
    """What each node of the job gets (a training node is not overcommitted: requests equal limits)."""

    cpu: str
    memory: str
    gpus: int = 0
    shm_size: str = "1Gi"
    """Size of the node's ``/dev/shm`` (the data loader's and NCCL's shared memory)."""

    def kubernetes(self) -> dict[str, dict[str, str]]:
        """As a container's ``resources``: requests equal to limits, quantities as strings."""
        limits = {"cpu": self.cpu, "memory": self.memory}
        if self.gpus:
            limits["nvidia.com/gpu"] = str(self.gpus)
        return {"requests": dict(limits), "limits": limits}


@dataclass(frozen=True)
class RestartPolicy:
    """How a failed training is restarted."""

    max_restarts: int
    """torchrun restarts the worker group in place this many times (resuming from the latest checkpoint)."""
    retryable_exit_codes: tuple[int, ...]
    """A node that exits with one of these is started again by its scheduler (the pod, the JobSet, a
    Slurm requeue); any other non-zero code fails the job for good (:mod:`relaunch.components.core.contract.exitcodes`)."""


@dataclass(frozen=True)
class JobSpec:
    """One distributed training job, whatever runs it: what :func:`job_spec` returns and every
    launcher renders."""

    name: str
    """The pipeline's name (the Slurm job's name; Kubernetes jobs add the pipeline run)."""
    image: str
    image_pull_policy: str
    config_json: str
    """The workers' configuration (``--config-json``)."""
    env: tuple[tuple[str, str], ...]
    """Plain environment of the job's containers (the local launcher runs in the caller's environment)."""
    secrets: tuple[SecretEnv, ...]
    """Credentials, as env from Secrets: the job carries Secret names, never values."""
    resources: Resources
    nodes: int
    min_nodes: int
    """The elastic minimum (equal to ``nodes`` for a fixed-size job)."""
    procs_per_node: int
    monitor_interval_seconds: float
    restart: RestartPolicy
    grace_seconds: float
    """How long a preempted worker has to commit a checkpoint after SIGTERM."""
    store_uri: str
    tracking_uri: str
    module: str = TRAIN_MODULE
    """What each worker runs: ``python -m <module> --config-json JSON``."""
    secret_files: tuple[SecretFile, ...] = ()
    """Credentials as files from Secrets (a gs:// store's key file), each with its path in env."""

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.nodes

    def nnodes(self) -> str:
        """torchrun's ``--nnodes``: ``N``, or the elastic range ``MIN:N``."""
        return f"{self.min_nodes}:{self.nodes}" if self.elastic else str(self.nodes)

    def torchrun_args(self, *, rdzv_endpoint: str, rdzv_id: str, node_count: str | None = None,
                      rdzv_conf: str | None = None, extra: Sequence[str] = (), config_json: str | None = None,
                      worker: Sequence[str] = ()) -> list[str]:
        """torchrun's arguments (what follows ``torchrun``), the one command every launcher runs.

        Args:
            rdzv_endpoint: ``host:port`` of the c10d rendezvous (the only thing launchers really differ in).
            rdzv_id: the rendezvous id, the same on every node of one job.
            node_count: ``--nnodes`` when the launcher knows better (Slurm's ``$SLURM_NNODES``).
            rdzv_conf: ``--rdzv-conf`` (``is_host=true`` for the local agent that hosts the store).
            extra: further torchrun flags, placed before the training module.
            config_json: what ``--config-json`` gets (a shell word); defaults to :attr:`config_json`.
            worker: the worker command prefix when workers come from the node's zygote
                (:func:`relaunch.components.core.runtime.zygote.client_command`): torchrun then runs
                ``--no-python *worker -m relaunch.components.train ...`` instead of ``python -u -m relaunch.components.train ...``.

        Returns:
            ``[--nnodes=..., ..., -m, relaunch.components.train, --config-json, JSON]``.
        """
        args = [f"--nnodes={node_count or self.nnodes()}", f"--nproc-per-node={self.procs_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
        if rdzv_conf:
            args.append(f"--rdzv-conf={rdzv_conf}")
        args += [f"--max-restarts={self.restart.max_restarts}", f"--monitor-interval={self.monitor_interval_seconds:g}",
                 *extra, *(("--no-python", *worker) if worker else ()), "-m", self.module, "--config-json", self.config_json if config_json is None else config_json]
        return args

    def plain_env(self) -> list[dict[str, Any]]:
        """:attr:`env` as container env entries."""
        return [{"name": name, "value": value} for name, value in self.env]

    def secret_env(self) -> list[dict[str, Any]]:
        """:attr:`secrets` as ``secretKeyRef`` env entries."""
        return secret_refs(self.secrets)


def job_spec(config: RelaunchConfig, *, resume_from: str | None = None) -> JobSpec:
    """The training job of ``config`` (side-effect free; the only place a job is read from the configuration).

    Args:
        config: the resolved configuration; it travels to the workers as ``--config-json`` and holds
            no credentials (those come from the Secrets named in ``launch.kubernetes``).
        resume_from: checkpoint URI to start from (``train.resume_from``); None resumes from the latest.
    """
    launch, k8s = config.launch, config.launch.kubernetes
    return JobSpec(
        name=config.name, image=k8s.image, image_pull_policy=k8s.image_pull_policy,
        config_json=worker_config(config, resume_from).to_json(),
        env=tuple((e["name"], e["value"]) for e in plain_env(k8s)),
        secrets=tuple(SecretEnv(secret, keys, optional) for secret, keys, optional
                      in secret_env_sources(k8s, config.store.uri)),
        secret_files=store_secret_files(k8s, config.store.uri),
        resources=Resources(cpu=str(k8s.cpu), memory=str(k8s.memory), gpus=k8s.gpus_per_node, shm_size=k8s.shm_size),
        nodes=launch.nodes, min_nodes=launch.min_nodes or launch.nodes, procs_per_node=launch.procs_per_node,
        monitor_interval_seconds=launch.monitor_interval_seconds,
        restart=RestartPolicy(max_restarts=launch.max_restarts, retryable_exit_codes=tuple(sorted(int(c) for c in RETRYABLE))),
        grace_seconds=config.train.preempt_grace_seconds, store_uri=config.store.uri, tracking_uri=config.tracking.uri,
    )


# --------------------------------------------------------------------------- what every manifest shares


def secret_env_sources(k8s, store_uri: str = "") -> list[tuple[str, tuple[str, ...], bool]]:
    """``(secret name, keys, optional)`` of every Secret a relaunch container reads: the one list the
    jobs, the Argo steps and the KFP tasks (:mod:`relaunch.pipelines.kfp_cluster`) are built from; the store
    Secret's keys follow the scheme of ``store_uri`` (STORE_SECRETS_BY_SCHEME). A gs:// store reads no
    keys from env: its Secret is a mounted file (:func:`store_secret_files`)."""
    scheme = store_uri.split("://", 1)[0] if "://" in store_uri else ""
    keys, optional = STORE_SECRETS_BY_SCHEME.get(scheme, (STORE_SECRET_KEYS, False))
    sources = [] if scheme == "gs" else [(k8s.store_secret, keys, optional)]
    if k8s.tracking_secret:
        sources.append((k8s.tracking_secret, TRACKING_SECRET_KEYS, True))
    if k8s.study_secret:
        sources.append((k8s.study_secret, STUDY_SECRET_KEYS, False))
    return sources


def store_secret_files(k8s, store_uri: str) -> tuple[SecretFile, ...]:
    """The store's credentials as files: for a gs:// store, key ``key.json`` of the store Secret as
    ``GOOGLE_APPLICATION_CREDENTIALS``; none with an empty ``store_secret`` (workload identity: the
    pods' ServiceAccount is bound to a Google service account) or another store."""
    if store_uri.startswith("gs://") and k8s.store_secret:
        return (SecretFile(k8s.store_secret, GCS_KEY_FILE, GCS_KEY_DIR, "GOOGLE_APPLICATION_CREDENTIALS"),)
    return ()


def secret_file_volumes(files: Iterable[SecretFile]) -> list[dict[str, Any]]:
    """Pod volumes of Secret files (one per Secret, only the keys named, mode 0400)."""
    return [{"name": _volume_name(f), "secret": {"secretName": f.secret, "defaultMode": 0o400,
                                                 "items": [{"key": f.key, "path": f.key}]}} for f in files]


def secret_file_mounts(files: Iterable[SecretFile]) -> list[dict[str, Any]]:
    """Read-only container mounts of :func:`secret_file_volumes`."""
    return [{"name": _volume_name(f), "mountPath": f.mount_dir, "readOnly": True} for f in files]


def _volume_name(f: SecretFile) -> str:
    return f"secret-{f.secret}"[:63].rstrip("-")


def secret_refs(secrets: Iterable[SecretEnv]) -> list[dict[str, Any]]:
    """Credentials as ``secretKeyRef`` env entries (the Secret key equals the variable's name)."""
    env = []
    for source in secrets:
        for key in source.keys:
            ref: dict[str, Any] = {"name": source.secret, "key": key}
            if source.optional:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def secret_env(k8s, store_uri: str = "") -> list[dict[str, Any]]:
    """Credentials as env entries, for every relaunch container (the Argo steps too): ``secretKeyRef``
    entries, and the paths of the Secret files of :func:`store_secret_files` (which the container
    mounts with :func:`secret_file_volumes` and :func:`secret_file_mounts`)."""
    files = [{"name": f.env, "value": f.path} for f in store_secret_files(k8s, store_uri)]
    return files + secret_refs(SecretEnv(*source) for source in secret_env_sources(k8s, store_uri))


def plain_env(k8s) -> list[dict[str, Any]]:
    """Non-secret environment every relaunch container gets."""
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if k8s.store_endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": k8s.store_endpoint})
    return env


def training_env(spec: JobSpec, pipeline_run_id: str | None) -> list[dict[str, Any]]:
    """The training container's whole environment: plain values, the run id (when there is one: a
    runtime serves many runs), credentials by reference."""
    run = [{"name": "RELAUNCH_PIPELINE_RUN_ID", "value": pipeline_run_id}] if pipeline_run_id else []
    files = [{"name": f.env, "value": f.path} for f in spec.secret_files]
    return spec.plain_env() + run + files + spec.secret_env()


def worker_config(config: RelaunchConfig, resume_from: str | None) -> RelaunchConfig:
    """The configuration the workers get: ``resume_from`` folded in (None resumes from the latest)."""
    worker = config.model_copy(deep=True)
    if resume_from:
        worker.train.resume_from = resume_from
    return worker


def supervised(torchrun_args: list[str], *, warm: bool = True) -> list[str]:
    """The container command: torchrun under the supervisor that maps its blanket exit 1 to the
    contract's code (:mod:`relaunch.components.launchers.supervise`).

    ``warm``: the workers are forks of the pod's zygote (:mod:`relaunch.components.core.runtime.zygote`, which the
    supervisor starts before torchrun): torchrun's worker command becomes its stdlib client,
    ``--no-python python -I -S /tmp/relaunch-zygote/client.py -m relaunch.components.train ...``, which falls back to
    the cold ``python -u -m relaunch.components.train ...`` by itself when the zygote is missing.
    """
    if warm:
        torchrun_args = with_zygote_worker(torchrun_args)
    return ["python", "-m", "relaunch.components.launchers.supervise", "torchrun", *torchrun_args]


def with_zygote_worker(torchrun_args: list[str], python: str = "python") -> list[str]:
    """``torchrun_args`` (what :meth:`JobSpec.torchrun_args` returns, ending ``-m MODULE --config-json J``)
    with the pod zygote's client as the worker command."""
    if len(torchrun_args) < 4 or torchrun_args[-4] != "-m" or torchrun_args[-2] != "--config-json":
        raise ValueError(f"not JobSpec.torchrun_args: {torchrun_args[-4:]}")
    if "--no-python" in torchrun_args:
        return list(torchrun_args)
    return [*torchrun_args[:-4], "--no-python", *client_command(python, CLIENT_PATH), *torchrun_args[-4:]]


def job_metadata(spec: JobSpec, k8s, pipeline_run_id: str, owner: dict | None) -> dict[str, Any]:
    """Name, namespace, labels, run annotation and the optional owner reference of a training job."""
    metadata: dict[str, Any] = {
        "name": job_name(spec.name, pipeline_run_id, STEP),
        "namespace": k8s.namespace,
        "labels": {"app.kubernetes.io/name": "relaunch", "app.kubernetes.io/component": "training",
                   RUN_LABEL: run_hash(pipeline_run_id)},
        "annotations": {RUN_ANNOTATION: pipeline_run_id},
    }
    if owner:
        metadata["ownerReferences"] = [{
            "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["name"], "uid": owner["uid"],
            "blockOwnerDeletion": False, "controller": False,
        }]
    return metadata


def owner_from_env(environ: dict[str, str] | None = None) -> dict | None:
    """The owner reference the Argo launch step passes in ``RELAUNCH_OWNER_*``, or None."""
    environ = os.environ if environ is None else environ
    owner = {field: environ.get(var, "") for field, var in OWNER_ENV.items()}
    return owner if all(owner.values()) else None


# --------------------------------------------------------------------------- a backend, and a job's state


@dataclass(frozen=True)
class JobState:
    """Where a job stands: ``phase`` is Pending, Suspended, Running, Succeeded or Failed."""

    phase: str
    message: str = ""
    restarts: int = 0
    progress: str = ""  # what the cluster reports of the training's progress (TrainJob trainerStatus)

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class JobKind:
    """What differs between PyTorchJob and TrainJob; the launcher is written against this only."""

    group: str
    version: str
    plural: str
    kind: str
    container: str                                  # the training container's name in every pod
    pod_selector: Callable[[str], str]              # job name -> label selector of its pods
    is_node0: Callable[[dict], bool]                # the pod whose log is streamed
    state: Callable[[dict], JobState]               # the job's status -> JobState
    summary: Callable[[dict], str]                  # a short line of replica/job counts

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


def describe_conditions(conditions: Iterable[dict]) -> str:
    return "; ".join(
        f"{c.get('type')}={c.get('status')}" + (f" ({c.get('reason')}: {c.get('message')})" if c.get("message") else "")
        for c in conditions
    )


def pod_exit_codes(pods: list[dict], container: str) -> list[tuple[int, str]]:
    """Every ended pod or training container of a job as ``(exit code of the contract, why)``
    (:func:`relaunch.components.core.contract.classify.classify_pod` of each pod)."""
    return [(int(code), why) for pod in pods for code, why in classify_pod(pod, container)]


def unstartable_reason(pods: list[dict]) -> str | None:
    """A container that can never start (bad image name, missing Secret key): wait no longer."""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in UNSTARTABLE_REASONS:
                return f"pod {pod['metadata'].get('name')}: {waiting['reason']}: {waiting.get('message', '')}".strip()
    return None


def unscheduled_reason(pods: list[dict]) -> str | None:
    """Why pods are not placed (``PodScheduled=False``: no node fits, quota), or None."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and str(cond.get("status")) == "False":
                return f"pod {pod['metadata'].get('name')} not scheduled: {cond.get('reason')}: {cond.get('message', '')}".strip()
    return None


def failure_exit_code(kind: JobKind, job: dict, pods: list[dict]) -> tuple[int, str]:
    """Map a failed job to one exit code of the contract, with the evidence as the message.

    A permanent code anywhere wins (one rank's bad input fails the job for good); then a retryable
    one; a job that ran past its deadline is a timeout (138, like the local launcher); codes outside
    the contract and a failure with no evidence are treated as a bug (1).
    """
    state = kind.state(job)
    codes = pod_exit_codes(pods, kind.container)
    for wanted in (PERMANENT, RETRYABLE):
        for code, why in codes:
            if code in wanted:
                return code, f"{why}; conditions: {state.message}"
    if "deadline" in state.message.lower():
        return int(ExitCode.RETRY_ME), f"job ran past its active deadline; conditions: {state.message}"
    if codes:
        code, why = codes[0]
        return int(ExitCode.BUG), f"{why} (exit code {code} is not in the contract); conditions: {state.message}"
    return int(ExitCode.BUG), f"job failed without an exit code; conditions: {state.message}"
