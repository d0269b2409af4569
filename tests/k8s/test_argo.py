"""The Argo Workflow, WorkflowTemplate and CronWorkflow: valid against the Argo v4.0.5 schemas, retried
exactly as the exit-code table says, wired like the KFP pipeline, and free of credentials."""

from __future__ import annotations

import re

import pytest
from jsonschema import Draft7Validator, Draft202012Validator

from relaunch.components.core.contract.config_loading import load_config
from relaunch.pipelines.spec import DELETE_JOB, EXIT_HANDLER_RETRY, RETRY_POLICIES, STEPS
from relaunch.components.core.contract.exitcodes import PERMANENT, RETRYABLE, argo_retry_expression
from relaunch.pipelines.argo import BUILDERS, to_dict

KINDS = {"argo": ("Workflow", "argoproj.io_workflows.yaml"),
         "argo-template": ("WorkflowTemplate", "argoproj.io_workflowtemplates.yaml"),
         "argo-cron": ("CronWorkflow", "argoproj.io_cronworkflows.yaml")}
CLUSTER_OVERRIDES = ["launch.backend=pytorchjob", "store.uri=s3://relaunch/store",
                     "tracking.uri=http://mlflow.relaunch.svc:5000", "launch.kubernetes.gpus_per_node=1"]


@pytest.fixture(scope="module")
def documents() -> dict[str, dict]:
    config = load_config(None, CLUSTER_OVERRIDES)
    return {target: to_dict(build(config)) for target, build in BUILDERS.items()}


def workflow_spec(doc: dict) -> dict:
    return doc["spec"]["workflowSpec"] if doc["kind"] == "CronWorkflow" else doc["spec"]


def templates(doc: dict) -> dict[str, dict]:
    return {t["name"]: t for t in workflow_spec(doc)["templates"]}


# --------------------------------------------------------------------------- schemas


@pytest.mark.schemas
@pytest.mark.parametrize("target", list(KINDS))
def test_every_compiled_document_validates_against_the_argo_json_schema(target, documents, argo_definitions):
    kind, _ = KINDS[target]
    definitions = dict(argo_definitions)
    # schema.json types IntOrString as a plain string (see ../shared/schemas/README.md); the CRDs do not.
    definitions["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"type": ["integer", "string"]}
    validator = Draft202012Validator({"$ref": f"#/definitions/io.argoproj.workflow.v1alpha1.{kind}",
                                      "definitions": definitions})
    errors = sorted(validator.iter_errors(documents[target]), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


@pytest.mark.schemas
@pytest.mark.parametrize("target", list(KINDS))
def test_every_compiled_document_validates_against_its_argo_crd(target, documents, crd_schema):
    kind, crd = KINDS[target]
    doc = documents[target]
    assert (doc["apiVersion"], doc["kind"]) == ("argoproj.io/v1alpha1", kind)
    errors = list(Draft7Validator(crd_schema(f"argo-workflows/{crd}")).iter_errors(doc))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


def test_the_cron_workflow_runs_one_at_a_time_and_skips_missed_starts(documents):
    spec = documents["argo-cron"]["spec"]
    assert spec["schedules"] and "schedule" not in spec
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["startingDeadlineSeconds"] > 0


# --------------------------------------------------------------------------- retries


class _Expr:
    """A strict evaluator of the expr-lang subset the retry expression uses: ``||``, ``&&``, ``!``,
    ``==``, ``!=``, ``in [...]``, parentheses, 'strings' and ``lastRetry.*`` (all strings in Argo)."""

    TOKEN = re.compile(r"\s*(\|\||&&|==|!=|!|\(|\)|\[|\]|,|in\b|'[^']*'|[A-Za-z_][\w.]*)")

    def __init__(self, text: str, env: dict[str, str]) -> None:
        self.tokens, pos = [], 0
        while pos < len(text.rstrip()):
            match = self.TOKEN.match(text, pos)
            assert match, f"unexpected text at {text[pos:]!r}"
            self.tokens.append(match.group(1))
            pos = match.end()
        self.env, self.i = env, 0

    def value(self) -> bool:
        result = self._or()
        assert self.i == len(self.tokens), f"trailing tokens {self.tokens[self.i:]}"
        return result

    def _peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _take(self, want=None):
        tok = self.tokens[self.i]
        assert want is None or tok == want, f"expected {want}, got {tok}"
        self.i += 1
        return tok

    def _or(self):
        left = self._and()
        while self._peek() == "||":
            self._take()
            right = self._and()
            left = left or right
        return left

    def _and(self):
        left = self._unary()
        while self._peek() == "&&":
            self._take()
            right = self._unary()
            left = left and right
        return left

    def _unary(self):
        if self._peek() == "!":
            self._take()
            return not self._unary()
        return self._compare()

    def _compare(self):
        left = self._atom()
        op = self._peek()
        if op in ("==", "!=", "in"):
            self._take()
            right = self._atom()
            return {"==": lambda: left == right, "!=": lambda: left != right, "in": lambda: left in right}[op]()
        return left

    def _atom(self):
        tok = self._take()
        if tok == "(":
            inner = self._or()
            self._take(")")
            return inner
        if tok == "[":
            items = []
            while self._peek() != "]":
                items.append(self._atom())
                if self._peek() == ",":
                    self._take()
            self._take("]")
            return items
        if tok.startswith("'"):
            return tok[1:-1]
        return self.env[tok]


def retried(exit_code: str, status: str) -> bool:
    return _Expr(argo_retry_expression(), {"lastRetry.exitCode": exit_code, "lastRetry.status": status}).value()


@pytest.mark.parametrize("code", sorted(RETRYABLE))
def test_the_retry_expression_retries_every_retryable_code(code):
    assert retried(str(code), "Failed")
    assert retried(str(code), "Error")


@pytest.mark.parametrize("code", sorted(PERMANENT))
def test_the_retry_expression_never_retries_a_permanent_code(code):
    assert not retried(str(code), "Failed")
    assert not retried(str(code), "Error")


def test_the_retry_expression_retries_a_pod_lost_with_its_node():
    assert retried("-1", "Error")  # Argo's exit code when the pod vanished
    assert not retried("-1", "Failed")


def test_every_step_is_retried_by_the_table_on_another_node(documents):
    for doc in documents.values():
        by_name = templates(doc)
        for step in STEPS:
            strategy = by_name[step]["retryStrategy"]
            policy = RETRY_POLICIES[step]
            assert strategy["limit"] == policy.limit
            assert strategy["expression"] == argo_retry_expression()
            assert strategy["retryPolicy"] == "Always"
            assert strategy["backoff"]["duration"] == f"{policy.backoff_seconds}s"
            assert strategy["backoff"]["factor"] == policy.factor
            assert strategy["backoff"]["cap"] == f"{policy.max_backoff_seconds}s"
            assert "maxDuration" in strategy["backoff"]
            assert strategy["affinity"] == {"nodeAntiAffinity": {}}


# --------------------------------------------------------------------------- wiring


def test_the_dag_is_the_five_steps_in_order_with_register_gated(documents):
    dag = templates(documents["argo"])["relaunch"]["dag"]["tasks"]
    assert [t["name"] for t in dag] == list(STEPS)
    depends = {t["name"]: t.get("depends") for t in dag}
    assert depends == {"prepare": None, "locate-latest-checkpoint": "prepare", "launch": "locate-latest-checkpoint",
                       "evaluate": "launch", "register": "evaluate"}
    assert dag[-1]["when"] == "{{tasks.evaluate.outputs.parameters.passed}} == true"


def test_the_exit_handler_closes_the_mlflow_run_and_deletes_the_job_unless_the_workflow_succeeded(documents):
    spec = documents["argo"]["spec"]
    handler = templates(documents["argo"])[spec["onExit"]]["dag"]["tasks"]
    by_name = {t["name"]: t for t in handler}
    assert set(by_name) == {"finalize", "delete-training-job"}
    assert "when" not in by_name["finalize"]
    assert by_name["delete-training-job"]["when"] == "{{workflow.status}} != Succeeded"
    args = {p["name"]: p["value"] for p in by_name["finalize"]["arguments"]["parameters"]}
    assert args["pipeline_run_id"] == "{{workflow.uid}}"


def test_the_launch_step_names_the_workflow_as_the_jobs_owner(documents):
    env = {e["name"]: e.get("value") for e in templates(documents["argo"])["launch"]["container"]["env"]}
    assert env["RELAUNCH_OWNER_UID"] == "{{workflow.uid}}"
    assert env["RELAUNCH_OWNER_NAME"] == "{{workflow.name}}"
    assert env["RELAUNCH_OWNER_KIND"] == "Workflow"


def test_credentials_reach_every_step_only_as_secret_key_refs(documents):
    for doc in documents.values():
        spec = workflow_spec(doc)
        assert spec["serviceAccountName"] == "relaunch-pipeline"
        assert spec["artifactRepositoryRef"] == {"configMap": "artifact-repositories", "key": "minio"}
        for template in spec["templates"]:
            if "container" not in template:
                continue
            env = {e["name"]: e for e in template["container"]["env"]}
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD"):
                assert set(env[key]) == {"name", "valueFrom"}, (template["name"], key)
                assert "secretKeyRef" in env[key]["valueFrom"]


def test_the_exit_handler_steps_keep_retrying_so_a_transient_error_never_orphans_a_job(documents):
    for doc in documents.values():
        by_name = templates(doc)
        for step in ("finalize", DELETE_JOB.name):
            strategy = by_name[step]["retryStrategy"]
            assert strategy["limit"] == EXIT_HANDLER_RETRY.limit >= 3, step
            assert strategy["expression"] == argo_retry_expression()
            assert strategy["retryPolicy"] == "Always"


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob"])
def test_the_backend_travels_in_the_workflows_configuration_to_launch_and_the_exit_handler(backend):
    import json

    doc = to_dict(BUILDERS["argo"](load_config(None, [*CLUSTER_OVERRIDES, f"launch.backend={backend}"])))
    params = {p["name"]: p["value"] for p in doc["spec"]["arguments"]["parameters"]}
    assert json.loads(params["config_json"])["launch"]["backend"] == backend
    delete = templates(doc)[DELETE_JOB.name]["container"]
    assert delete["command"] == ["python", "-m", "relaunch.components.launchers.cluster"]
