"""One neutral job spec (relaunch.components.launchers.jobs.JobSpec) and every launcher renders it: change one
field of the spec and the change shows in the local torchrun commands, the PyTorchJob, the TrainJob,
the ClusterTrainingRuntime and the Slurm script, each where that backend says it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.launchers.jobs import JobSpec, RestartPolicy, Resources, SecretEnv, job_spec
from relaunch.components.launchers.local import build_commands
from relaunch.components.launchers.pytorchjob import build_pytorchjob, render_pytorchjob
from relaunch.components.launchers.slurm import render_sbatch, render_spec
from relaunch.components.launchers.trainjob import build_runtime, build_trainjob, render_runtime, render_trainjob

CONFIG = RelaunchConfig()
BASE = job_spec(CONFIG)


def render_all(spec: JobSpec) -> dict[str, str]:
    """Every launcher's rendering of ``spec``, as text."""
    k8s, trainjob = CONFIG.launch.kubernetes, CONFIG.launch.trainjob
    return {
        "local": json.dumps(build_commands(spec, job_id="job-1", port=29555)),
        "pytorchjob": yaml.safe_dump(render_pytorchjob(spec, k8s, pipeline_run_id="uid-1")),
        "trainjob": yaml.safe_dump(render_trainjob(spec, k8s, trainjob, pipeline_run_id="uid-1")),
        "trainingruntime": yaml.safe_dump(render_runtime(spec, k8s, trainjob)),
        "slurm": render_spec(spec),
    }


CLUSTER = ("pytorchjob", "trainjob", "trainingruntime")
COMMANDS = ("local", *CLUSTER, "slurm")
CHANGES = [
    # (the change, what each launcher that renders that field must then show)
    ({"image": "registry.example/other:9"}, dict.fromkeys(CLUSTER, "registry.example/other:9")),
    ({"procs_per_node": 5}, {**dict.fromkeys(COMMANDS, "--nproc-per-node=5"),
                             "pytorchjob": "nProcPerNode: 5", "trainjob": "numProcPerNode: 5"}),
    ({"nodes": 6, "min_nodes": 6}, {"local": "--nnodes=6", "pytorchjob": "replicas: 5", "trainjob": "numNodes: 6",
                                    "trainingruntime": "numNodes: 6", "slurm": "#SBATCH --nodes=6\n"}),
    ({"nodes": 6, "min_nodes": 2}, {**dict.fromkeys(("local", *CLUSTER), "--nnodes=2:6"), "slurm": "#SBATCH --nodes=2-6\n"}),
    ({"restart": RestartPolicy(max_restarts=9, retryable_exit_codes=BASE.restart.retryable_exit_codes)},
     {**dict.fromkeys(COMMANDS, "--max-restarts=9"), "pytorchjob": "maxRestarts: 9"}),
    ({"restart": RestartPolicy(max_restarts=3, retryable_exit_codes=(137, 143))},
     {"trainingruntime": "operator: In\n                  values:\n                  - 137\n                  - 143\n",
      "slurm": 'case " 137 143 " in'}),
    ({"env": (("RELAUNCH_EXTRA", "on"),)}, dict.fromkeys(CLUSTER, "name: RELAUNCH_EXTRA\n")),
    ({"secrets": (SecretEnv("other-secret", ("TOKEN",), optional=True),)}, dict.fromkeys(CLUSTER, "name: other-secret\n")),
    ({"resources": Resources(cpu="7", memory="9Gi", gpus=2, shm_size="3Gi")},
     {**dict.fromkeys(CLUSTER, "nvidia.com/gpu: '2'"), "slurm": "#SBATCH --cpus-per-task=7\n#SBATCH --gpus-per-node=2\n"}),
    ({"config_json": '{"name": "from-the-spec"}'}, dict.fromkeys(COMMANDS, "from-the-spec")),
    ({"grace_seconds": 61.0}, {"slurm": "--shutdown-timeout=61"}),
]


@pytest.mark.parametrize("change, shows", CHANGES, ids=[",".join(change) for change, _ in CHANGES])
def test_each_launcher_renders_a_changed_field_of_the_job_spec(change, shows):
    before, after = render_all(BASE), render_all(dataclasses.replace(BASE, **change))
    for launcher, text in shows.items():
        assert text in after[launcher], (launcher, change)
        assert text not in before[launcher], (launcher, change)


def test_a_launcher_renders_nothing_of_the_configuration_beyond_the_spec_and_its_backends_section():
    # the configuration's JSON reaches the workers only through JobSpec.config_json
    spec = dataclasses.replace(BASE, config_json="{}")
    for launcher, text in render_all(spec).items():
        assert CONFIG.to_json() not in text, launcher


@pytest.mark.parametrize("overrides", [[], ["launch.nodes=4", "launch.min_nodes=2", "launch.procs_per_node=8",
                                             "launch.kubernetes.gpus_per_node=8", "launch.kubernetes.tracking_secret=mlflow"]])
def test_building_from_the_configuration_is_rendering_its_job_spec(overrides):
    config = load_config(None, overrides)
    spec = job_spec(config, resume_from="s3://bucket/ck")
    k8s, trainjob = config.launch.kubernetes, config.launch.trainjob
    assert build_pytorchjob(config, pipeline_run_id="u", resume_from="s3://bucket/ck") == render_pytorchjob(
        spec, k8s, pipeline_run_id="u")
    assert build_trainjob(config, pipeline_run_id="u", resume_from="s3://bucket/ck") == render_trainjob(
        spec, k8s, trainjob, pipeline_run_id="u")
    assert build_runtime(config) == render_runtime(job_spec(config), k8s, trainjob)
    assert render_sbatch(config) == render_spec(job_spec(config))


def test_the_job_spec_takes_what_it_says_from_the_configuration():
    config = load_config(None, ["launch.nodes=3", "launch.procs_per_node=2", "launch.max_restarts=5",
                                "launch.kubernetes.gpus_per_node=1", "train.preempt_grace_seconds=40"])
    spec = job_spec(config, resume_from="s3://bucket/ck")
    assert (spec.nodes, spec.min_nodes, spec.procs_per_node, spec.restart.max_restarts) == (3, 3, 2, 5)
    assert not spec.elastic and spec.nnodes() == "3"
    assert spec.resources.gpus == 1 and spec.grace_seconds == 40.0
    assert spec.restart.retryable_exit_codes == (130, 137, 138, 143)
    assert RelaunchConfig.from_json(spec.config_json).train.resume_from == "s3://bucket/ck"
    assert config.train.resume_from is None, "the caller's configuration is not changed"
    k8s = config.launch.kubernetes
    assert [(s.secret, s.optional) for s in spec.secrets] == [(k8s.store_secret, False), (k8s.tracking_secret, True)]
