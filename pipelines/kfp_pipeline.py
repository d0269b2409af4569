"""The relaunch pipeline as Kubeflow Pipelines v2: prepare -> locate-latest-checkpoint -> launch ->
evaluate -> register (only when evaluate's gate passed), inside an exit handler whose ``finalize``
task closes the MLflow run (FAILED when the pipeline failed). Wiring only: each component body
imports :func:`pipelines.kfp_entry.call`, which runs the step's ``run``.

    python -m pipelines.kfp_pipeline build/pipeline.kfp.yaml     # or: relaunch compile --target kfp

The same definition runs on one machine with ``kfp.local`` (``relaunch run``, :mod:`pipelines.local_run`).
Retries come from :data:`components.core.exitcodes.RETRY_POLICIES`; caching is off for every step (a
cached "latest checkpoint" is a wrong one, and prepare's outputs include this run's MLflow run).
"""

# no `from __future__ import annotations`: kfp reads the component annotations as real types
import sys
from typing import NamedTuple

from kfp import compiler, dsl

from components.core.config import KubernetesConfig, RelaunchConfig
from components.core.exitcodes import RETRY_POLICIES

IMAGE = KubernetesConfig.model_fields["image"].default
DEFAULT_CONFIG_JSON = RelaunchConfig().to_json()


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def prepare(config_json: str, pipeline_run_id: str, epochs: int, max_steps: int, learning_rate: float,
            nodes: int, procs_per_node: int, inject_failure: str, resume_from: str, warm_start_model: str,
            run_name: str) -> NamedTuple("PrepareOutputs", [("config_json", str), ("run_id", str),
                                                            ("dataset_version", str), ("dataset_uri", str)]):
    """Build or reuse the dataset, open the MLflow run, resolve the configuration."""
    from pipelines.kfp_entry import call

    return call("prepare", config_json, pipeline_run_id=pipeline_run_id, epochs=epochs, max_steps=max_steps,
                learning_rate=learning_rate, nodes=nodes, procs_per_node=procs_per_node,
                inject_failure=inject_failure, resume_from=resume_from, warm_start_model=warm_start_model,
                run_name=run_name)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def locate_latest_checkpoint(config_json: str) -> NamedTuple(
        "LocateOutputs", [("checkpoint_uri", str), ("step", int), ("source", str)]):
    """The checkpoint training starts from ("" when none)."""
    from pipelines.kfp_entry import call

    return call("locate-latest-checkpoint", config_json)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def launch(config_json: str, resume_from: str, pipeline_run_id: str) -> NamedTuple(
        "LaunchOutputs", [("exit_code", int), ("restarts", int), ("resumed_from_steps", str),
                          ("train_seconds", float), ("duration_seconds", float), ("ettr", float),
                          ("last_checkpoint_uri", str), ("job_name", str)]):
    """Run the distributed training to its end (local torchrun agents or a PyTorchJob)."""
    from pipelines.kfp_entry import call

    return call("launch", config_json, resume_from=resume_from, pipeline_run_id=pipeline_run_id)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def evaluate(config_json: str) -> NamedTuple(
        "EvaluateOutputs", [("metrics_json", str), ("passed", bool), ("checkpoint_uri", str), ("step", int)]):
    """Metrics of the final checkpoint on the held-out split, and the gate's verdict."""
    from pipelines.kfp_entry import call

    return call("evaluate", config_json)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def register(config_json: str, checkpoint_uri: str, metrics_json: str) -> NamedTuple(
        "RegisterOutputs", [("model_name", str), ("version", str), ("aliases", str),
                            ("champion_version", str), ("champion_decision", str)]):
    """Register the model version, set challenger/champion, pin its checkpoint."""
    from pipelines.kfp_entry import call

    return call("register", config_json, checkpoint_uri=checkpoint_uri, metrics_json=metrics_json)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def finalize(config_json: str, pipeline_run_id: str, status: dsl.PipelineTaskFinalStatus) -> NamedTuple(
        "FinalizeOutputs", [("run_id", str), ("status", str)]):
    """Exit task: mark the MLflow run FINISHED, or FAILED with the reason."""
    from pipelines.kfp_entry import call

    return call("finalize", config_json, pipeline_run_id=pipeline_run_id, state=status.state,
                error=status.error_message or "")


def _step(task: dsl.PipelineTask, step: str) -> dsl.PipelineTask:
    policy = RETRY_POLICIES[step]
    task.set_retry(num_retries=policy.limit, backoff_duration=f"{policy.backoff_seconds}s",
                   backoff_factor=float(policy.factor), backoff_max_duration=f"{policy.max_backoff_seconds}s")
    task.set_caching_options(False)
    return task


@dsl.pipeline(name="relaunch", description="Fault-tolerant, resumable distributed PyTorch training: "
              "prepare, locate the latest checkpoint, launch, evaluate, register.")
def relaunch_pipeline(config_json: str = DEFAULT_CONFIG_JSON, epochs: int = 0, max_steps: int = 0,
                      learning_rate: float = 0.0, nodes: int = 0, procs_per_node: int = 0,
                      inject_failure: str = "", resume_from: str = "", warm_start_model: str = "",
                      run_name: str = ""):
    """Train, evaluate and register a model; a retried or re-run pipeline resumes from the latest checkpoint.

    Args:
        config_json: The whole relaunch configuration as JSON (see the README's configuration reference); the parameters below override single fields of it.
        epochs: train.epochs, passes over the training split; 0 keeps the configuration's value.
        max_steps: train.max_steps, stop after this many optimizer steps; 0 keeps the configuration's value.
        learning_rate: train.lr, the peak learning rate; 0 keeps the configuration's value.
        nodes: launch.nodes, number of nodes; 0 keeps the configuration's value.
        procs_per_node: launch.procs_per_node, training processes per node; 0 keeps the configuration's value.
        inject_failure: launch.inject_failure, kill-worker@step=N, preempt@step=N or storage-outage@step=N; empty for none.
        resume_from: train.resume_from, a checkpoint URI to start from; empty for the latest of this training.
        warm_start_model: train.warm_start_model, models:/name/version or models:/name@alias; empty for none.
        run_name: tracking.run_name, display name of a new MLflow run; empty for MLflow's choice.
    """
    closing = finalize(config_json=config_json, pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
    closing.set_caching_options(False)
    with dsl.ExitHandler(closing, name="relaunch-run"):
        prep = _step(prepare(config_json=config_json, pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                             epochs=epochs, max_steps=max_steps, learning_rate=learning_rate, nodes=nodes,
                             procs_per_node=procs_per_node, inject_failure=inject_failure,
                             resume_from=resume_from, warm_start_model=warm_start_model, run_name=run_name),
                     "prepare")
        resolved = prep.outputs["config_json"]
        located = _step(locate_latest_checkpoint(config_json=resolved), "locate-latest-checkpoint")
        trained = _step(launch(config_json=resolved, resume_from=located.outputs["checkpoint_uri"],
                               pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER), "launch")
        evaluated = _step(evaluate(config_json=resolved), "evaluate").after(trained)
        with dsl.If(evaluated.outputs["passed"] == True, name="gate-passed"):  # noqa: E712 - a DSL expression
            _step(register(config_json=resolved, checkpoint_uri=evaluated.outputs["checkpoint_uri"],
                           metrics_json=evaluated.outputs["metrics_json"]), "register")


def compile_pipeline(path: str, config: RelaunchConfig | None = None) -> None:
    """Write the KFP v2 pipeline YAML to ``path``.

    Args:
        path: output file.
        config: the configuration whose JSON becomes ``config_json``'s default and whose
            ``launch.kubernetes.image`` every step runs in; the defaults when None.
    """
    import yaml

    config = config or RelaunchConfig()
    compiler.Compiler().compile(relaunch_pipeline, path, pipeline_parameters={"config_json": config.to_json()})
    image = config.launch.kubernetes.image
    if image != IMAGE:  # components are decorated once, with the default image; point them at this one
        with open(path) as fh:
            docs = list(yaml.safe_load_all(fh))
        for executor in docs[0]["deploymentSpec"]["executors"].values():
            executor["container"]["image"] = image
        with open(path, "w") as fh:
            yaml.safe_dump_all(docs, fh, sort_keys=True)


if __name__ == "__main__":
    compile_pipeline(sys.argv[1] if len(sys.argv) > 1 else "pipeline.kfp.yaml")
