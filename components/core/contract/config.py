"""The one configuration model of relaunch, read by every step, the training entrypoint, the local
run and the KFP/Argo definitions: its sections and fields, each field's validation, and the one-line
description of a refusal (:func:`describe_validation_error`).

Unknown keys and wrong types are refused; every error names the field and the bad value in one line
(:class:`~relaunch.components.core.contract.errors.BadInput`, exit code 2). Credentials never live here: they come from
the environment (or Kubernetes Secrets mapped into it). Beside it, each concern in its own module:

- :mod:`~relaunch.components.core.contract.config_loading`: defaults, a YAML file or ``--config-json``, then
  ``--set dotted.key=value`` overrides (``load_config``, ``config_from_cli``);
- :mod:`~relaunch.components.core.contract.uris`: the URI and path checks the validators call;
- :mod:`~relaunch.components.core.contract.pipeline_parameters`: the typed KFP/Argo pipeline parameters
  and their folding into a configuration;
- :mod:`~relaunch.components.core.contract.suggestions`: a trial's suggested values applied to a configuration;
- :mod:`~relaunch.components.core.contract.reference_tables`: the generated tables of docs/configuration.md
  and README.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from .errors import BadInput
from .registry import launch_backend, launch_backend_names, parse_store_uri
from .uris import (MODEL_URI, check_artifact_location, check_http_url,
                   check_tracking_uri, expand_home)

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
FAILURE_SPEC = re.compile(r"^(?P<kind>kill-worker|preempt|storage-outage)@step=(?P<step>\d+)$")
"""``launch.inject_failure``: ``kill-worker@step=N``, ``preempt@step=N`` or ``storage-outage@step=N``."""


RENAMED_TASKS = {"components.tasks.digits:make_task": "relaunch.components.tasks.digits:make_task"}
"""relaunch's own tasks under the names they had before relaunch installed under ``relaunch.*``: a
training started then stored its ``train.task`` so, and resumes under the new name."""


def current_task_spec(spec: Any) -> Any:
    """``spec`` under the name relaunch's own task has now (:data:`RENAMED_TASKS`), else unchanged."""
    return RENAMED_TASKS.get(spec, spec) if isinstance(spec, str) else spec


def parse_failure_spec(spec: str | None) -> tuple[str | None, int]:
    """``("kill-worker", 30)`` for ``kill-worker@step=30``; ``(None, -1)`` when no failure is injected."""
    if not spec:
        return None, -1
    match = FAILURE_SPEC.match(spec)
    if not match:
        raise ValueError(f"{spec!r} is not a failure spec; use kill-worker@step=N, preempt@step=N or storage-outage@step=N")
    return match["kind"], int(match["step"])


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StoreConfig(_Model):
    uri: str = Field(
        "./.relaunch/store",
        description="Where datasets and checkpoints live: a path, file:///path, or s3://bucket/prefix "
        "(endpoint and credentials from AWS_*/MINIO_* environment variables).",
    )

    @field_validator("uri")
    @classmethod
    def _uri_scheme(cls, v: str) -> str:
        v = expand_home(v)
        parse_store_uri(v)
        return v


class WandbConfig(_Model):
    """Weights & Biases as a second tracker (components/core/tracking/wandb_tracker.py); credentials only
    from the environment (``WANDB_API_KEY``, ``WANDB_BASE_URL`` for a self-hosted server)."""

    project: str = Field(..., min_length=1, description="W&B project the training's run goes to.")
    entity: str | None = Field(None, description="W&B team or user; the API key's default entity when empty.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="online sends as it goes; offline writes under WANDB_DIR for a later `wandb sync`.")


class TrackingConfig(_Model):
    uri: str = Field(
        "sqlite:///./.relaunch/mlflow.db",
        description="MLflow tracking URI: sqlite:///file.db, postgresql+psycopg2://..., or http(s)://server.",
    )
    artifact_location: str | None = Field(
        "./.relaunch/mlartifacts",
        description="Artifact root for a newly created experiment (ignored when the server proxies artifacts).",
    )
    experiment: str = Field("relaunch", description="MLflow experiment name.")
    run_id: str | None = Field(None, description="MLflow run to log into; decided by prepare when empty.")
    run_name: str | None = Field(None, description="Display name of a newly created MLflow run.")
    tensorboard_dir: str | None = Field(None, description="Also write TensorBoard events here when set.")
    wandb: WandbConfig | None = Field(None, description="Also track in Weights & Biases when set.")

    @field_validator("uri")
    @classmethod
    def _tracking_scheme(cls, v: str) -> str:
        return check_tracking_uri(v)

    @field_validator("artifact_location")
    @classmethod
    def _artifact_uri(cls, v: str | None) -> str | None:
        return v if v is None else check_artifact_location(v)

    @field_validator("tensorboard_dir")
    @classmethod
    def _tensorboard_dir(cls, v: str | None) -> str | None:
        return v if v is None else expand_home(v)


class DataConfig(_Model):
    dataset: str = Field("digits", description="Dataset the task builds; the default task uses scikit-learn's bundled digits.")
    version: str | None = Field(None, description="Content-addressed dataset version; set by prepare.")
    val_fraction: float = Field(0.15, gt=0, lt=0.5, description="Fraction held out for validation.")
    test_fraction: float = Field(0.15, gt=0, lt=0.5, description="Fraction held out for the final test.")
    split_seed: int = Field(0, ge=0, description="Seed of the train/validation/test split.")
    num_workers: int = Field(1, ge=0, description="Loader worker processes per rank that fetch and check the shards of its batches (0: in the training process).")
    prefetch_batches: int = Field(2, ge=1, description="Batches each loader worker fetches ahead.")


class TrainConfig(_Model):
    task: str = Field("relaunch.components.tasks.digits:make_task", description="package.module:factory returning the Task.")
    epochs: int = Field(4, ge=1, description="Passes over the training split.")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    global_batch_size: int = Field(64, ge=1, description="Samples per optimizer step across all ranks.")
    grad_clip_norm: float | None = Field(None, gt=0, description="Clip the global gradient norm to this before each optimizer step (none: not clipped; the norm is logged either way).")
    grad_accum_steps: int = Field(1, ge=1, description="Micro-batches each rank's share of a global batch is cut into (forward and backward each, gradients accumulated, one optimizer step).")
    lr: float = Field(0.05, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW/SGD weight decay.")
    hidden_size: int = Field(128, ge=1, description="Width of the default task's hidden layer.")
    seed: int = Field(0, ge=0, description="Seed of model init, data order and every RNG.")
    deterministic: bool = Field(True, description="Deterministic algorithms, so a resumed run is bitwise equal.")
    amp: bool = Field(False, description="Mixed precision (bf16 on CPU, fp16 + GradScaler on CUDA).")
    parallelism: Literal["ddp", "fsdp"] = Field("ddp", description="ddp replicates the model on every rank; fsdp shards parameters, gradients and optimizer state (FSDP2 fully_shard per block).")
    mixed_precision: Literal["none", "bf16", "fp16"] = Field("none", description="FSDP parameter/compute dtype (gradients are reduced in float32); needs parallelism=fsdp.")
    step_sleep_seconds: float = Field(0.0, ge=0, description="Artificial delay per step (demos and benchmarks).")
    checkpoint_every_steps: int | None = Field(20, ge=1, description="Save every N optimizer steps.")
    checkpoint_every_seconds: float | None = Field(None, gt=0, description="Save at most every T seconds.")
    checkpoint_at_epoch_end: bool = Field(True, description="Save when an epoch ends.")
    async_save: bool = Field(True, description="Persist checkpoints in the background.")
    memory_tier: bool | None = Field(None, description="Recover from memory: each rank keeps its two newest snapshots of its state and two of one peer's as replicas (4x its shard of host memory: a kill while the newest is handed over is served at the one before); a killed worker is replaced in place, the survivors keep their processes (the in-place agent on every node instead of torchrun: locally one per simulated node, in a TrainJob's or PyTorchJob's pods under the supervisor; node 0's hosts the group's store). Unset: on for a local launch of more than one rank in a fixed group, off otherwise (on a cluster until one confirms the in-pod path, docs/cluster.md item 17); false turns it off.")
    memory_snapshot_every_steps: int | None = Field(None, ge=0, description="With memory_tier: snapshot the state into memory every this many steps, beside the training (the optimizer step waits only for the copy, never for the hand-over to the peer); a failure then recomputes at most the steps since. Unset: as often as keeps the training's time on snapshots under 0.1% (every step of a step over ~0.1 s). 0: only each checkpoint save's copy is kept (handed to the tier while the store is written).")
    store_unwritable_saves: int = Field(3, ge=1, description="Failed saves in a row, the store full or read-only, after which the training stops (exit 2); it goes on past fewer.")
    keep_last: int = Field(3, ge=1, description="Committed checkpoints kept by recency.")
    keep_best: int = Field(1, ge=0, description="Committed checkpoints kept by best_metric.")
    best_metric: str = Field("val_loss", description="Metric that ranks checkpoints for keep_best.")
    best_mode: Literal["min", "max"] = Field("min", description="Whether lower or higher best_metric is better.")
    eval_every_steps: int | None = Field(None, ge=1, description="Validate every N steps (default: at each checkpoint).")
    log_every_steps: int = Field(1, ge=1, description="Log per-step metrics every N steps.")
    loss_spike_factor: float = Field(10.0, gt=1, description="A loss above factor x its running mean counts as a spike.")
    hang_timeout_seconds: float = Field(300.0, gt=0, description="No step progress for this long: dump stacks, exit retryable.")
    preempt_grace_seconds: float = Field(25.0, gt=0, description="Time after SIGTERM before SIGKILL (terminationGracePeriodSeconds - margin).")
    process_group_timeout_seconds: float = Field(120.0, gt=0, description="torch.distributed collective timeout.")
    resume_from: str | None = Field(None, description="Checkpoint URI to start from instead of the latest of this run.")
    warm_start_model: str | None = Field(None, description="models:/name/version or models:/name@alias to initialise weights from.")
    task_options: dict[str, Any] = Field(default_factory=dict, description="A user task's own settings (its factory reads config.train.task_options); a tune.space key may name one as train.task_options.<name>.")

    @field_validator("task")
    @classmethod
    def _current_task_name(cls, v: str) -> str:
        return current_task_spec(v)

    @field_validator("warm_start_model")
    @classmethod
    def _model_uri(cls, v: str | None) -> str | None:
        if v is not None and not MODEL_URI.match(v):
            raise ValueError(f"{v!r} is not models:/name/version or models:/name@alias")
        return v

    @model_validator(mode="after")
    def _mixed_precision_needs_fsdp(self) -> "TrainConfig":
        if self.mixed_precision != "none" and self.parallelism != "fsdp":
            raise ValueError(f"mixed_precision={self.mixed_precision!r} needs parallelism=fsdp (with ddp use train.amp)")
        return self


class KubernetesConfig(_Model):
    namespace: str = Field("relaunch", description="Namespace of the training job (TrainJob or PyTorchJob) and the pipeline pods.")
    image: str = Field("ghcr.io/relaunch/relaunch:0.1.0", description="Image every step and worker runs.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="imagePullPolicy of every pod.")
    service_account: str = Field("relaunch-pipeline", description="ServiceAccount of the pipeline pods and workers.")
    gpus_per_node: int = Field(0, ge=0, description="nvidia.com/gpu per replica; 0 trains on CPU with gloo.")
    cpu: str = Field("2", description="CPU request and limit per replica.")
    memory: str = Field("4Gi", description="Memory request and limit per replica.")
    shm_size: str = Field("1Gi", description="Size of the /dev/shm emptyDir.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodeSelector of the training replicas.")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations of the training replicas.")
    store_secret: str = Field("relaunch-store", description="Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.")
    tracking_secret: str | None = Field(
        "relaunch-mlflow", description="Secret with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (optional)."
    )
    study_secret: str | None = Field(
        None, description="Secret with PGPASSWORD, the password of tune.storage's PostgreSQL (a study's pipeline steps; libpq reads it)."
    )
    store_endpoint: str | None = Field("http://minio.relaunch.svc:9000", description="AWS_ENDPOINT_URL given to pods.")
    @field_validator("store_endpoint")
    @classmethod
    def _endpoint_url(cls, v: str | None) -> str | None:
        return v if not v else check_http_url(v, "store endpoint")

    backoff_limit: int = Field(6, ge=0, description="PyTorchJob runPolicy.backoffLimit: pod restarts before the job fails.")
    clean_pod_policy: Literal["None", "Running", "All"] = Field("None", description="PyTorchJob runPolicy.cleanPodPolicy.")
    ttl_seconds_after_finished: int = Field(86400, ge=0, description="Delete the finished job after this long (PyTorchJob runPolicy; the runtime's JobSet).")
    active_deadline_seconds: int | None = Field(None, ge=1, description="Deadline of the running job (PyTorchJob runPolicy, TrainJob spec.activeDeadlineSeconds).")
    termination_grace_period_seconds: int = Field(30, ge=1, description="Pod grace period between SIGTERM and SIGKILL.")
    wait_timeout_seconds: float = Field(86400.0, gt=0, description="How long launch waits for the job, queued or running; then 138, and the next attempt adopts it.")


class TrainJobConfig(_Model):
    runtime: str = Field("relaunch-torch", description="ClusterTrainingRuntime the TrainJob references (manifests/trainer/).")
    max_restarts: int = Field(3, ge=0, description="JobSet failurePolicy.maxRestarts of the rendered runtime: "
                              "whole-group restarts after a retryable exit code.")
    queue_name: str | None = Field(None, description="Kueue LocalQueue (label kueue.x-k8s.io/queue-name); "
                                   "the TrainJob waits Suspended until Kueue admits it.")

    @field_validator("runtime")
    @classmethod
    def _dns_label(cls, v: str) -> str:
        if len(v) > 63 or not _NAME.match(v):
            raise ValueError(f"{v!r} is not a DNS label (a-z, 0-9, '-', at most 63 characters); "
                             "name the ClusterTrainingRuntime you applied, e.g. relaunch-torch")
        return v


class LaunchConfig(_Model):
    backend: str = Field(
        "local", description="Where training runs: local agents (relaunch's in-place agents with train.memory_tier, else torchrun), a Kubeflow PyTorchJob (Training Operator "
        "v1) or a TrainJob (Kubeflow Trainer v2); any backend registered in components/launchers/__init__.py.")
    nodes: int = Field(2, ge=1, description="Nodes (local: simulated node groups on this machine).")
    procs_per_node: int = Field(1, ge=1, description="Training processes per node.")
    max_restarts: int = Field(3, ge=0, description="torchrun/elastic restarts of the worker group.")
    min_nodes: int | None = Field(None, ge=1, description="Elastic minimum; defaults to nodes.")
    rdzv_port: int = Field(0, ge=0, le=65535, description="Local c10d rendezvous port; 0 picks a free one.")
    monitor_interval_seconds: float = Field(0.2, gt=0, description="torchrun's worker-health poll interval (a dead worker is noticed within it: part of every restart's time).")
    timeout_seconds: float = Field(3600.0, gt=0, description="Give up (retryable) after this long.")
    inject_failure: str | None = Field(None, description="kill-worker@step=N, preempt@step=N or storage-outage@step=N.")
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    trainjob: TrainJobConfig = Field(default_factory=TrainJobConfig)

    @property
    def on_cluster(self) -> bool:
        """Whether training runs as a Kubernetes job (a cluster backend)."""
        return launch_backend(self.backend).cluster

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, v: str) -> str:
        if v not in launch_backend_names():
            raise ValueError(f"{v!r} is not a launch backend; use one of {', '.join(launch_backend_names())}")
        return v

    @field_validator("inject_failure")
    @classmethod
    def _failure_spec(cls, v: str | None) -> str | None:
        parse_failure_spec(v)
        return v

    @model_validator(mode="after")
    def _elastic_range(self) -> "LaunchConfig":
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes={self.min_nodes} exceeds nodes={self.nodes}")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class EvaluateConfig(_Model):
    checkpoint: Literal["latest", "best"] = Field("latest", description="Which committed checkpoint to evaluate.")
    split: Literal["test", "val"] = Field("test", description="Held-out split to evaluate on.")
    gate_metric: str = Field("accuracy", description="Metric the register gate reads.")
    gate_min: float = Field(0.5, description="Register only when gate_metric >= gate_min.")


class RegistryConfig(_Model):
    model_name: str = Field("relaunch-digits", description="Registered model name in the MLflow registry.")
    champion_metric: str = Field("accuracy", description="Metric compared with the current champion.")
    champion_mode: Literal["min", "max"] = Field("max", description="Whether lower or higher champion_metric is better.")
    champion_margin: float = Field(0.0, ge=0, description="New version must beat the champion by at least this.")


class LoggingConfig(_Model):
    """How every relaunch process (steps, torchrun agents, workers) writes its log lines
    (components/core/runtime/logs.py)."""

    format: Literal["text", "json"] = Field(
        "text", description="json: one JSON object a line on stderr with training_id, attempt, rank, node and "
        "step (for Loki or Elasticsearch); passed to child processes as RELAUNCH_LOG_FORMAT.")


class TuneParameter(_Model):
    """How one configuration field is searched."""

    type: Literal["uniform", "log_uniform", "int", "categorical"] = Field(
        ..., description="uniform and log_uniform draw a float in [low, high]; int an integer in [low, high] "
                         "(log-spaced with log: true); categorical one of choices.")
    low: float | None = Field(None, description="Lowest value (uniform, log_uniform, int).")
    high: float | None = Field(None, description="Highest value (uniform, log_uniform, int).")
    step: float | None = Field(None, gt=0, description="Spacing of the values (uniform, int); none: continuous / 1.")
    log: bool = Field(False, description="int only: draw on a log scale.")
    choices: list[Any] | None = Field(None, description="The values to choose from (categorical).")

    @model_validator(mode="after")
    def _bounds(self) -> "TuneParameter":
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical parameter needs a non-empty choices list, e.g. choices: [32, 64]")
            if self.low is not None or self.high is not None:
                raise ValueError("a categorical parameter takes choices, not low/high")
            return self
        if self.choices is not None:
            raise ValueError(f"a {self.type} parameter takes low and high, not choices (or use type: categorical)")
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} parameter needs both low and high, e.g. low: 0.001, high: 0.1")
        if self.low >= self.high:
            raise ValueError(f"low={self.low:g} must be below high={self.high:g}")
        if (self.type == "log_uniform" or self.log) and self.low <= 0:
            raise ValueError(f"a log scale needs bounds above 0 (got low={self.low:g}); raise low or use type: uniform")
        if self.type == "int" and not (float(self.low).is_integer() and float(self.high).is_integer()):
            raise ValueError(f"an int parameter needs whole bounds (got low={self.low:g}, high={self.high:g})")
        if self.step is not None and self.type == "log_uniform":
            raise ValueError("a log_uniform parameter takes no step")
        if self.type == "int" and self.step is not None and not float(self.step).is_integer():
            raise ValueError(f"an int parameter needs a whole step (got step={self.step:g})")
        if self.type == "int" and self.log and self.step not in (None, 1):
            raise ValueError("an int parameter on a log scale takes no step (Optuna draws it log-spaced); drop step or log")
        return self


class TuneObjective(_Model):
    metric: str = Field("val_loss", min_length=1, description="Validation metric the study optimises (val_loss, val_accuracy, ...), reported at each validation.")
    direction: Literal["minimize", "maximize"] = Field("minimize", description="Whether lower or higher metric is better.")


class TuneSampler(_Model):
    name: Literal["tpe", "random"] = Field("tpe", description="Optuna sampler; Katib and OptimizationJob render the nearest algorithm.")
    seed: int = Field(0, ge=0, description="Seed of the sampler: the same study suggests the same trials.")


class TunePruner(_Model):
    name: Literal["median", "none"] = Field("median", description="Stop a trial whose intermediate metric is worse than the median of earlier trials at the same step.")
    startup_trials: int = Field(2, ge=0, description="Trials that complete before any is pruned.")
    warmup_steps: int = Field(0, ge=0, description="Steps of a trial before it may be pruned.")


class TuneConfig(_Model):
    """A study of trainings over a search space (``relaunch tune``; Katib / OptimizationJob on a cluster)."""

    study: str | None = Field(None, description="Study name (kebab-case); defaults to the pipeline name. Trials go to studies/<study>/trials/<n>/ of the store.")
    space: dict[str, TuneParameter] = Field(default_factory=dict, description="Configuration field (train.lr, train.task_options.<name>, ...) -> how it is searched.")
    objective: TuneObjective = Field(default_factory=TuneObjective)
    trials: int = Field(8, ge=1, description="Trials that complete (or are pruned) before the study ends.")
    parallel: int = Field(2, ge=1, description="Trials running at once.")
    sampler: TuneSampler = Field(default_factory=TuneSampler)
    pruner: TunePruner = Field(default_factory=TunePruner)
    storage: str | None = Field(None, description="Optuna storage URL; default: a sqlite database in the study's local folder (a PostgreSQL URL on a cluster).")
    trial_retries: int = Field(2, ge=0, description="Times a failed trial is retried (it resumes from its own checkpoints); a user error is never retried.")
    cluster: Literal["katib", "optimizationjob"] = Field("katib", description="What a cluster study renders: a Katib Experiment, or a Trainer OptimizationJob (its CRD is on the Trainer's main branch, in no release and without a controller yet).")

    @field_validator("study")
    @classmethod
    def _kebab_study(cls, v: str | None) -> str | None:
        if v is not None and (not _NAME.match(v) or len(v) > 40):
            raise ValueError(f"{v!r} must be kebab-case (a-z, 0-9, '-'), at most 40 characters")
        return v

    @field_validator("space", mode="before")
    @classmethod
    def _dotted_keys(cls, v: Any) -> Any:
        """``{train: {lr: {...}}}`` (what ``--set tune.space.train.lr=...`` builds) -> ``{"train.lr": {...}}``."""
        if not isinstance(v, dict):
            return v
        flat: dict[str, Any] = {}

        def walk(node: dict[str, Any], prefix: str) -> None:
            for key, value in node.items():
                path = f"{prefix}{key}"
                if isinstance(value, dict) and "type" not in value and value:
                    walk(value, f"{path}.")
                else:
                    flat[path] = value

        walk(v, "")
        return flat

    @field_validator("space")
    @classmethod
    def _tunable_fields(cls, v: dict[str, TuneParameter]) -> dict[str, TuneParameter]:
        for path, parameter in v.items():
            check_tunable(path, parameter)
        return v

    @model_validator(mode="after")
    def _parallel_within_trials(self) -> "TuneConfig":
        if self.parallel > self.trials:
            raise ValueError(f"parallel={self.parallel} exceeds trials={self.trials}; lower tune.parallel")
        return self


def memory_tier_on(config: "RelaunchConfig") -> bool:
    """Whether ``config``'s training recovers from memory: ``train.memory_tier`` when set; unset, where
    relaunch's in-place agent is tested end to end (a local launch) with a peer to hold each rank's
    replica and a fixed group. A cluster's jobs opt in (docs/cluster.md item 17)."""
    if config.train.memory_tier is not None:
        return config.train.memory_tier
    launch = config.launch
    backend = launch_backend(launch.backend)
    fixed = launch.min_nodes is None or launch.min_nodes == launch.nodes
    return backend.in_place and not backend.cluster and launch.world_size > 1 and fixed


class RelaunchConfig(_Model):
    """The whole pipeline's configuration."""

    name: str = Field("relaunch", description="Pipeline name: kebab-case, used in job and workflow names.")
    store: StoreConfig = Field(default_factory=StoreConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)

    @field_validator("name")
    @classmethod
    def _kebab(cls, v: str) -> str:
        if not _NAME.match(v) or len(v) > 40:
            raise ValueError(f"{v!r} must be kebab-case (a-z, 0-9, '-'), at most 40 characters")
        return v

    @model_validator(mode="after")
    def _memory_tier_fixed_group(self) -> "RelaunchConfig":
        if self.train.memory_tier and not launch_backend(self.launch.backend).in_place:
            agents = ", ".join(n for n in launch_backend_names() if launch_backend(n).in_place)
            raise ValueError(f"train.memory_tier runs under relaunch's in-place agent, which launch.backend="
                             f"{self.launch.backend} does not use (it restarts its group itself); use launch.backend "
                             f"{agents}, or set train.memory_tier=false")
        if self.train.memory_tier and self.launch.min_nodes is not None and self.launch.min_nodes < self.launch.nodes:
            raise ValueError(f"train.memory_tier keeps a fixed group of launch.nodes={self.launch.nodes}, but "
                             f"launch.min_nodes={self.launch.min_nodes} makes it elastic; drop launch.min_nodes "
                             "or set train.memory_tier=false")
        return self

    @property
    def study_name(self) -> str:
        return self.tune.study or self.name

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> "RelaunchConfig":
        try:
            return cls.model_validate_json(text)
        except ValidationError as err:
            raise BadInput(describe_validation_error(err)) from None


def config_field(path: str) -> FieldInfo:
    """The field of the configuration at ``path`` (``train.lr``), its annotation and description.

    Raises:
        KeyError, AttributeError: no such field.
    """
    model: type[BaseModel] = RelaunchConfig
    *sections, name = path.split(".")
    for section in sections:
        model = model.model_fields[section].annotation
    return model.model_fields[name]


def check_tunable(path: str, parameter: TuneParameter) -> None:
    """Refuse a ``tune.space`` key that names no scalar configuration field (with the nearest name),
    or a parameter whose type the field cannot hold (a float drawn for an int field).

    Raises:
        ValueError: one line, raised inside validation (reported as ``config: tune.space: ...``).
    """
    parts = path.split(".")
    if parts[:2] == ["train", "task_options"] and len(parts) == 3 and parts[2]:
        return
    if parts[0] == "tune":
        raise ValueError(f"key {path!r}: the study's own settings cannot be tuned")
    try:
        field = config_field(path)
    except (KeyError, AttributeError):
        guess = _did_you_mean(parts)
        hint = f"did you mean {guess!r}?" if guess else "name a field such as train.lr (docs/configuration.md)"
        raise ValueError(f"key {path!r} is not a configuration field; {hint}") from None
    annotation = field.annotation
    kinds = {t for t in (int, float, str, bool) if t is annotation or t in getattr(annotation, "__args__", ())}
    if not kinds:
        raise ValueError(f"key {path!r} is a section or a collection, not a value; name one of its fields")
    if parameter.type in ("uniform", "log_uniform") and float not in kinds:
        raise ValueError(f"key {path!r} holds {'/'.join(sorted(k.__name__ for k in kinds))}, "
                         f"so it cannot take a {parameter.type} float; use type: int or categorical")


def _did_you_mean(loc: list[str]) -> str | None:
    """The known key nearest to the unknown ``loc`` (``train.epoch`` -> ``train.epochs``), or None."""
    model: Any = RelaunchConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.6)
    return ".".join([*loc[:-1], close[0]]) if close else None


def _redacted(value: Any) -> Any:
    """``value`` with the password of a ``scheme://user:password@host`` URI replaced by ``***``."""
    return re.sub(r"(://[^/:@]*):[^/@]*@", r"\1:***@", value) if isinstance(value, str) else value


def describe_validation_error(err: ValidationError) -> str:
    """One line naming the first offending field, its value and what is expected."""
    first = err.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "config"
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        guess = _did_you_mean([str(p) for p in first["loc"]])
        hint = f"did you mean {guess!r}?" if guess else "remove it or check the spelling"
        return f"config: unknown key {field!r}; {hint} (see docs/configuration.md)"
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" (got {_redacted(value)!r})"
    more = f" and {len(err.errors()) - 1} more error(s)" if len(err.errors()) > 1 else ""
    return f"config: {field}: {msg}{shown}{more}"
