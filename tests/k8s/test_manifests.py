"""``kubectl kustomize manifests/...``: every document valid against the Kubernetes 1.33 OpenAPI
schemas (the batch/v1 Job included), each Role granting exactly what the pipeline and the chosen launch
backend need, and no credential in any Secret."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft7Validator

ROOT = Path(__file__).resolve().parents[2]
# Each build and the launch backend its Role is for (base alone has none: an overlay picks one).
BUILD_BACKEND = {"base": None, "overlays/kind": "trainjob", "overlays/basic-auth": "trainjob",
                 "overlays/pytorchjob": "pytorchjob"}
BUILDS = list(BUILD_BACKEND)
SCHEMA_FILES = {"v1": "api__v1_openapi.json", "apps/v1": "apis__apps__v1_openapi.json",
                "batch/v1": "apis__batch__v1_openapi.json",
                "rbac.authorization.k8s.io/v1": "apis__rbac.authorization.k8s.io__v1_openapi.json"}
DEFINITION_PREFIX = {"v1": "io.k8s.api.core.v1", "apps/v1": "io.k8s.api.apps.v1", "batch/v1": "io.k8s.api.batch.v1",
                     "rbac.authorization.k8s.io/v1": "io.k8s.api.rbac.v1"}
# (apiGroup, resource) -> verbs: every pipeline pod (Argo's executor), and the launch step per backend
# (tests/k8s/test_launcher_contract.py proves these are exactly the calls the launcher makes).
PIPELINE_GRANTS = {("argoproj.io", "workflowtaskresults"): {"create", "patch"}}
LAUNCH_GRANTS = {
    "trainjob": {("trainer.kubeflow.org", "trainjobs"): {"create", "get", "list", "watch", "delete"},
                 ("", "pods"): {"list"}, ("", "pods/log"): {"get"}},
    "pytorchjob": {("kubeflow.org", "pytorchjobs"): {"create", "get", "list", "watch", "delete"},
                   ("", "pods"): {"list"}, ("", "pods/log"): {"get"}},
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders the kustomizations)")
    out = {}
    for build in BUILDS:
        text = subprocess.run([kubectl, "kustomize", str(ROOT / "manifests" / build)], check=True,
                              capture_output=True, text=True).stdout
        out[build] = [d for d in yaml.safe_load_all(text) if d]
    return out


@pytest.fixture(scope="module")
def k8s_schemas(schemas_dir) -> dict[str, dict]:
    return {gv: json.loads((schemas_dir / "kubernetes" / f).read_text())["components"] for gv, f in SCHEMA_FILES.items()}


@pytest.mark.schemas
@pytest.mark.parametrize("build", BUILDS)
def test_every_rendered_document_validates_against_the_kubernetes_schemas(build, rendered, k8s_schemas):
    checked = 0
    for doc in rendered[build]:
        api, kind = doc["apiVersion"], doc["kind"]
        assert api in SCHEMA_FILES, f"no schema for {api} {kind}: add it"
        validator = Draft7Validator({"$ref": f"#/components/schemas/{DEFINITION_PREFIX[api]}.{kind}",
                                     "components": k8s_schemas[api]})
        errors = list(validator.iter_errors(doc))
        assert not errors, f"{kind}/{doc['metadata']['name']}: " + "; ".join(f"{list(e.path)}: {e.message}" for e in errors[:3])
        checked += 1
    assert checked >= 16
    assert "Job" in {d["kind"] for d in rendered[build]}


@pytest.mark.schemas
def test_the_kubernetes_schema_check_can_fail(k8s_schemas):
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"ports": [{"port": "http"}]}}
    validator = Draft7Validator({"$ref": "#/components/schemas/io.k8s.api.core.v1.Service", "components": k8s_schemas["v1"]})
    assert list(validator.iter_errors(service))


def grants(role: dict) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs")
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert "*" not in (group, resource) and "*" not in rule["verbs"]
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


@pytest.mark.parametrize("build", BUILDS)
def test_each_role_grants_nothing_beyond_what_the_pipeline_and_its_launch_backend_need(build, rendered):
    roles = {d["metadata"]["name"]: d for d in rendered[build] if d["kind"] in ("Role", "ClusterRole")}
    assert {r["kind"] for r in roles.values()} == {"Role"}, "namespaced Roles only, no ClusterRole"
    expected = {"relaunch-pipeline": PIPELINE_GRANTS}
    if BUILD_BACKEND[build]:
        expected[f"relaunch-launch-{BUILD_BACKEND[build]}"] = LAUNCH_GRANTS[BUILD_BACKEND[build]]
    if BUILD_BACKEND[build] == "trainjob":  # rank 0 reports progress (components/core/trainer/progress.py)
        expected["relaunch-trainjob-progress"] = {("trainer.kubeflow.org", "trainjobs/status"): {"patch"}}
    assert {name: grants(role) for name, role in roles.items()} == expected
    for name in roles:
        binding = next(d for d in rendered[build] if d["kind"] == "RoleBinding" and d["metadata"]["name"] == name)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "relaunch-pipeline", "namespace": "relaunch"}]
        assert binding["metadata"]["namespace"] == roles[name]["metadata"]["namespace"] == "relaunch"


@pytest.mark.parametrize("build", BUILDS)
def test_secret_templates_carry_placeholders_only(build, rendered):
    for secret in (d for d in rendered[build] if d["kind"] == "Secret"):
        assert "data" not in secret, "base64 data would hide a real value from review"
        for key, value in secret["stringData"].items():
            for line in str(value).splitlines():
                if any(word in (key + line).lower() for word in ("password", "secret", "access_key")):
                    assert "REPLACE_ME" in line or line.strip().startswith("["), (secret["metadata"]["name"], key)


def test_everything_lives_in_the_relaunch_namespace_with_the_argo_artifact_repository(rendered):
    docs = rendered["base"]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"relaunch"}
    repo = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "artifact-repositories")
    s3 = yaml.safe_load(repo["data"]["minio"])["s3"]
    assert s3["accessKeySecret"] == {"name": "relaunch-store", "key": "AWS_ACCESS_KEY_ID"}
    assert {"PersistentVolumeClaim", "Service", "Job", "Deployment"} <= {d["kind"] for d in docs}


@pytest.mark.schemas
def test_the_batch_job_schema_check_can_fail(k8s_schemas, rendered):
    job = next(d for d in rendered["base"] if d["kind"] == "Job")
    broken = {**job, "spec": {**job["spec"], "backoffLimit": "ten"}}
    validator = Draft7Validator({"$ref": "#/components/schemas/io.k8s.api.batch.v1.Job", "components": k8s_schemas["batch/v1"]})
    assert not list(validator.iter_errors(job))
    assert list(validator.iter_errors(broken))
