"""MLflow 3 lineage of the steps, in-process against a real MLflow (sqlite) and a real file store:
prepare's run name, dataset input, source tags and descriptions; evaluate's LoggedModel with its
metrics linked; the registered version made from it; finalize's outcome; the backend's params."""

from __future__ import annotations

import json

import pytest
import torch
from mlflow.tracking import MlflowClient

from relaunch.components import evaluate, finalize, prepare, register
from relaunch.components.core.packaging import model as models
from relaunch.components.core.tracking import lineage
from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.trainer.state import TrainingState
from relaunch.components.tasks.base import load_task


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """prepare -> (a checkpoint at step 12) -> evaluate -> register -> finalize."""
    root = tmp_path_factory.mktemp("lineage")
    config = RelaunchConfig.model_validate({
        "store": {"uri": str(root / "store" / "trainings" / "20261204-031500")},  # as `relaunch run` names it
        "tracking": {"uri": f"sqlite:///{root / 'mlflow.db'}", "artifact_location": str(root / "art")},
        "train": {"hidden_size": 8},
        "evaluate": {"gate_min": 0.0},
    })
    prepared = prepare.run(config, pipeline_run_id="lineage-1")
    resolved = RelaunchConfig.from_json(prepared.config_json)
    torch.manual_seed(0)
    CheckpointManager(resolved.store.uri, async_save=False).save(
        12, TrainingState(load_task(resolved.train.task, resolved).build_model()), metrics={"val_loss": 1.0})
    evaluated = evaluate.run(resolved)
    registered = register.run(resolved, evaluated.checkpoint_uri, evaluated.metrics_json)
    finalize.run(resolved)
    return resolved, prepared, evaluated, registered, MlflowClient(resolved.tracking.uri)


def test_the_run_is_named_after_the_pipeline_and_the_training_folder(pipeline):
    config, prepared, _, _, client = pipeline
    assert client.get_run(prepared.run_id).info.run_name == "relaunch-20261204-031500"


def test_a_store_outside_trainings_names_the_run_after_its_utc_start_time():
    config = RelaunchConfig.model_validate({"store": {"uri": "s3://bucket/team/digits"}})
    assert lineage.run_name(config, "sha256-0123456789abcdef", started=0.0) == "relaunch-19700101-000000"


def test_a_run_name_the_user_gave_wins(tmp_path):
    config = RelaunchConfig.model_validate({"tracking": {"run_name": "nightly"}})
    assert lineage.run_name(config, "sha256-0123456789abcdef") == "nightly"


def test_the_prepared_dataset_is_a_run_input_with_the_version_as_digest_and_the_store_as_source(pipeline):
    config, prepared, _, _, client = pipeline
    (entry,) = client.get_run(prepared.run_id).inputs.dataset_inputs
    assert entry.dataset.name == "digits" and entry.dataset.digest == prepared.dataset_version
    assert json.loads(entry.dataset.source)["uri"] == prepared.dataset_uri
    assert {t.key: t.value for t in entry.tags}["mlflow.data.context"] == "training"


def test_a_retried_prepare_logs_the_dataset_input_once(pipeline):
    config, prepared, _, _, client = pipeline
    again = prepare.run(config.model_copy(update={"tracking": config.tracking.model_copy(update={"run_id": None})}),
                        pipeline_run_id="lineage-1")
    assert again.run_id == prepared.run_id
    assert len(client.get_run(prepared.run_id).inputs.dataset_inputs) == 1


def test_the_run_carries_mlflows_source_git_and_user_tags(pipeline):
    _, prepared, _, _, client = pipeline
    tags = client.get_run(prepared.run_id).data.tags
    assert tags["mlflow.source.type"] == "JOB" and "relaunch" in tags["mlflow.source.name"]
    assert tags["mlflow.source.git.commit"] == lineage.git_commit() and tags["mlflow.user"]


def test_the_experiment_is_described_and_opens_in_the_model_training_view(pipeline):
    config, prepared, _, _, client = pipeline
    tags = client.get_experiment_by_name(config.tracking.experiment).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    assert "relaunch pipeline" in tags["mlflow.note.content"]


def test_the_run_description_says_what_the_pipeline_planned_and_what_it_did(pipeline):
    config, prepared, evaluated, registered, client = pipeline
    text = client.get_run(prepared.run_id).data.tags["mlflow.note.content"]
    assert f"`{config.train.task}`" in text and prepared.dataset_version in text  # the plan
    assert "Outcome: FINISHED" in text and f"Evaluated {evaluated.checkpoint_uri}: accuracy=" in text
    assert f"Registered `relaunch-digits` version {registered.version} (challenger, champion)" in text


def test_a_local_run_logs_no_kubernetes_params(pipeline):
    _, prepared, _, _, client = pipeline
    params = client.get_run(prepared.run_id).data.params
    assert params["launch.backend"] == "local" and params["launch.nodes"] == "2"
    assert not [k for k in params if k.startswith("launch.kubernetes.")]


@pytest.mark.parametrize("backend, kept, dropped", [
    ("local", {"launch.nodes"}, {"launch.kubernetes.image", "launch.trainjob.runtime"}),
    ("pytorchjob", {"launch.nodes", "launch.kubernetes.image"}, {"launch.trainjob.runtime"}),
    ("trainjob", {"launch.nodes", "launch.kubernetes.image", "launch.trainjob.runtime"}, set()),
])
def test_params_keep_only_the_chosen_backends_section(backend, kept, dropped):
    flat = {"launch.nodes": 2, "launch.kubernetes.image": "img", "launch.trainjob.runtime": "relaunch-torch"}
    out = lineage.backend_params(flat, backend)
    assert kept <= set(out) and not dropped & set(out)


def test_the_evaluated_checkpoint_is_a_logged_model_at_its_step_linked_to_the_run(pipeline):
    config, prepared, evaluated, _, client = pipeline
    model = lineage.find_logged_model(config, evaluated.checkpoint_uri)
    assert model is not None and str(model.status) == "READY"
    assert model.source_run_id == prepared.run_id and model.name == "step-000000000012"
    outputs = client.get_run(prepared.run_id).outputs.model_outputs
    assert [(o.model_id, o.step) for o in outputs] == [(model.model_id, 12)]


def test_evaluates_metrics_are_linked_to_the_logged_model_and_the_dataset(pipeline):
    config, prepared, evaluated, _, client = pipeline
    model = client.get_logged_model(lineage.find_logged_model(config, evaluated.checkpoint_uri).model_id)
    linked = {m.key: m for m in model.metrics}
    expected = json.loads(evaluated.metrics_json)
    assert {f"eval_test_{k}" for k in expected} <= set(linked)
    accuracy = linked["eval_test_accuracy"]
    assert accuracy.value == pytest.approx(expected["accuracy"]) and accuracy.step == 12
    assert (accuracy.dataset_name, accuracy.dataset_digest) == ("digits", prepared.dataset_version)


def test_the_registered_version_is_made_from_the_evaluated_logged_model(pipeline):
    config, _, evaluated, registered, client = pipeline
    version = client.get_model_version(config.registry.model_name, registered.version)
    # MLflow's database registry links a version to its LoggedModel through the source URI
    assert version.source == f"models:/{lineage.find_logged_model(config, evaluated.checkpoint_uri).model_id}"


def test_a_second_evaluate_of_the_same_checkpoint_reuses_its_logged_model(pipeline):
    config, prepared, evaluated, _, client = pipeline
    evaluate.run(config)
    run = client.get_run(prepared.run_id)
    found = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{prepared.run_id}'")
    assert len(found) == 1


def test_the_link_opens_the_run_in_the_model_training_view(pipeline):
    config, prepared, _, _, client = pipeline
    experiment_id = client.get_run(prepared.run_id).info.experiment_id
    assert prepared.experiment_id == experiment_id
    assert lineage.run_url(config, prepared.run_id, prepared.experiment_id) == (
        f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{prepared.run_id}?workflowType=machine_learning")


def test_a_task_outside_components_is_bundled_with_the_model(tmp_path, monkeypatch):
    (tmp_path / "mytask.py").write_text("")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    ours = models.code_paths("relaunch.components.tasks.digits:make_task", tmp_path / "a")
    assert ours == [str(tmp_path / "a" / "relaunch")]
    assert (tmp_path / "a" / "relaunch" / "components" / "core" / "packaging" / "model.py").is_file()
    assert models.code_paths("mytask:make_task", tmp_path / "b")[1:] == [str(tmp_path / "mytask.py")]
    assert models.code_paths("mypkg.sub:make_task", tmp_path / "c")[1:] == [str(tmp_path / "mypkg")]
