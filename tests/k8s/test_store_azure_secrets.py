"""An ``az://`` store's credentials reach every pod as env from the store Secret (each key optional: the
Secret holds one of the forms the Azure SDK reads), never as values, in every backend and compiled
pipeline; the documents still validate against the upstream schemas."""

from __future__ import annotations

import pytest
import yaml
from jsonschema import Draft7Validator

from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.launchers.jobs import AZURE_SECRET_KEYS, STORE_SECRET_KEYS
from relaunch.components.launchers.pytorchjob import build_pytorchjob
from relaunch.components.launchers.trainjob import build_runtime, build_trainjob
from relaunch.pipelines.commands.compile import render
from tests.k8s.test_parity_and_secrets import env_entries

AZURE = ["store.uri=az://relaunch/store", "tracking.uri=http://mlflow.relaunch.svc:5000"]


def _store_refs(doc) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env_entries(doc)
            if "valueFrom" in e and e["valueFrom"].get("secretKeyRef", {}).get("name") == "relaunch-store"}


def _documents() -> dict[str, list]:
    pytorchjob = load_config(None, ["launch.backend=pytorchjob", *AZURE])
    trainjob = load_config(None, ["launch.backend=trainjob", *AZURE])
    return {"pytorchjob": [build_pytorchjob(pytorchjob, pipeline_run_id="uid")],
            "trainjob": [build_trainjob(trainjob, pipeline_run_id="uid"), build_runtime(trainjob)],
            "argo": [d for d in yaml.safe_load_all(render("argo", pytorchjob)) if d]}


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob", "argo"])
def test_every_pod_of_an_azure_store_reads_the_azure_keys_of_the_store_secret_and_no_aws_keys(target):
    for doc in _documents()[target]:
        refs = _store_refs(doc)
        assert set(refs) == set(AZURE_SECRET_KEYS), (target, doc["kind"], sorted(refs))
        assert all(ref["optional"] is True and ref["key"] == name for name, ref in refs.items())
        names = {e["name"] for e in env_entries(doc)}
        assert not names & set(STORE_SECRET_KEYS), (target, doc["kind"])


def test_the_kfp_package_of_an_azure_store_maps_the_azure_keys_on_every_executor():
    docs = [d for d in yaml.safe_load_all(render("kfp", load_config(None, ["launch.backend=pytorchjob", *AZURE]))) if d]
    executors = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, config in executors.items():
        secrets = {s["secretName"]: {k["envVar"] for k in s["keyToEnv"]} for s in config["secretAsEnv"]}
        assert secrets["relaunch-store"] == set(AZURE_SECRET_KEYS), name


@pytest.mark.schemas
def test_the_azure_documents_validate_against_the_upstream_schemas(crd_schema, argo_definitions):
    from jsonschema import Draft202012Validator

    docs = _documents()
    trainjob, runtime = docs["trainjob"]
    for doc, crd in ((trainjob, "trainjobs"), (runtime, "clustertrainingruntimes")):
        schema = crd_schema(f"trainer-v2/trainer.kubeflow.org_{crd}.yaml")
        assert not list(Draft7Validator(schema).iter_errors(doc)), crd
    schema = crd_schema("training-operator/kubeflow.org_pytorchjobs.yaml", "v1")
    assert not list(Draft7Validator(schema).iter_errors(docs["pytorchjob"][0]))
    definitions = dict(argo_definitions)
    definitions["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"type": ["integer", "string"]}
    (workflow,) = docs["argo"]
    validator = Draft202012Validator({"$ref": f"#/definitions/io.argoproj.workflow.v1alpha1.{workflow['kind']}",
                                      "definitions": definitions})
    assert not list(validator.iter_errors(workflow))
