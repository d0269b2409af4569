"""A small HTTP server that implements the Kubeflow Pipelines v2beta1 REST endpoints ``kfp.Client`` calls
for ``relaunch submit|schedule --target kfp``, recording every request (the fake of an external system;
each test checks the bodies it recorded). State is kept in memory: pipelines, versions, experiments,
runs and recurring runs, with ids the server assigns, as the real API server does."""

from __future__ import annotations

import email
import email.policy
import json
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import yaml

PREFIX = "/apis/v2beta1"
# How the API server checks runtime_config.parameters against the pipeline's root inputs.
PARAMETER_TYPES = {"NUMBER_INTEGER": (int,), "NUMBER_DOUBLE": (int, float), "STRING": (str,), "BOOLEAN": (bool,),
                   "STRUCT": (dict,), "LIST": (list,)}


def type_errors(pipeline_spec: dict, body: dict) -> str:
    """Why the run's parameters do not fit the pipeline's inputs ("" when they do)."""
    declared = pipeline_spec.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    for name, value in ((body.get("runtime_config") or {}).get("parameters") or {}).items():
        if name not in declared:
            return f"unknown pipeline parameter {name}"
        wanted = PARAMETER_TYPES[declared[name]["parameterType"]]
        if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
            return f"parameter {name}: expected {declared[name]['parameterType']}, got {type(value).__name__}"
    return ""


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    json: dict | None = None
    files: dict[str, bytes] = field(default_factory=dict)


class KfpServer:
    """``with KfpServer() as kfp: ...``; ``kfp.url`` is the endpoint, ``kfp.requests`` what came in."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, dict] = {}
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.recurring_runs: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "KfpServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def calls(self, method: str, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method and r.path == PREFIX + path]

    # ----------------------------------------------------------------------- routes

    def route(self, req: Recorded) -> tuple[int, dict]:
        path = req.path.removeprefix(PREFIX)
        key = (req.method, path)
        if key == ("GET", "/healthz"):
            return 200, {"multi_user": False}
        if key == ("GET", "/pipelines"):
            return 200, self._listed("pipelines", self.pipelines, req)
        if key == ("POST", "/pipelines/upload"):
            return self._upload_pipeline(req)
        if key == ("POST", "/pipelines/upload_version"):
            return self._upload_version(req)
        if key == ("GET", "/experiments"):
            return 200, self._listed("experiments", self.experiments, req)
        if key == ("POST", "/experiments"):
            body = req.json or {}
            if not body.get("display_name"):
                return 400, {"error": "experiment display_name is required"}
            exp = {**body, "experiment_id": str(uuid.uuid4()), "storage_state": "AVAILABLE"}
            self.experiments[exp["experiment_id"]] = exp
            return 200, exp
        if key == ("POST", "/runs"):
            body = req.json or {}
            refused = type_errors((body.get("pipeline_spec") or {}).get("pipeline_spec") or {}, body)
            if refused:
                return 400, {"error": refused}
            run = {**body, "run_id": str(uuid.uuid4()), "state": "PENDING"}
            self.runs[run["run_id"]] = run
            return 200, run
        if key == ("POST", "/recurringruns"):
            body = req.json or {}
            version = self.versions.get((body.get("pipeline_version_reference") or {}).get("pipeline_version_id"))
            if version is None:
                return 400, {"error": "pipeline_version_reference names no uploaded version"}
            refused = type_errors(version["pipeline_spec"], body)
            if refused:
                return 400, {"error": refused}
            rec = {**body, "recurring_run_id": str(uuid.uuid4()), "status": "ENABLED"}
            self.recurring_runs[rec["recurring_run_id"]] = rec
            return 200, rec
        if req.method == "GET" and path.startswith("/experiments/"):
            exp = self.experiments.get(path.rsplit("/", 1)[1])
            return (200, exp) if exp else (404, {"error": "experiment not found"})
        if req.method == "GET" and path.startswith("/runs/"):
            run = self.runs.get(path.rsplit("/", 1)[1])
            return (200, run) if run else (404, {"error": "run not found"})
        return 404, {"error": f"{req.method} {req.path} is not a v2beta1 endpoint this server implements"}

    def _listed(self, kind: str, items: dict[str, dict], req: Recorded) -> dict:
        """A list, honouring the display_name EQUALS filter kfp.Client sends to find one by name."""
        found = list(items.values())
        raw = (req.query.get("filter") or [""])[0]
        if raw:
            for predicate in json.loads(raw).get("predicates", []):
                if predicate.get("key") in ("display_name", "name") and predicate.get("operation") in ("EQUALS", 1):
                    wanted = predicate.get("string_value", predicate.get("stringValue"))
                    found = [i for i in found if i.get("display_name") == wanted]
        return {kind: found, "total_size": len(found)} if found else {}

    def _upload_pipeline(self, req: Recorded) -> tuple[int, dict]:
        if "uploadfile" not in req.files:
            return 400, {"error": "uploadfile is required"}
        name = (req.query.get("name") or [""])[0]
        if any(p["display_name"] == name for p in self.pipelines.values()):
            return 409, {"error": f"pipeline {name} exists"}
        pipeline = {"pipeline_id": str(uuid.uuid4()), "display_name": name}
        self.pipelines[pipeline["pipeline_id"]] = pipeline
        self.versions[str(uuid.uuid4())] = {"pipeline_id": pipeline["pipeline_id"], "display_name": name}
        return 200, pipeline

    def _upload_version(self, req: Recorded) -> tuple[int, dict]:
        pipeline_id = (req.query.get("pipelineid") or [""])[0]
        if pipeline_id not in self.pipelines or "uploadfile" not in req.files:
            return 400, {"error": "pipelineid of an existing pipeline and uploadfile are required"}
        version = {"pipeline_version_id": str(uuid.uuid4()), "pipeline_id": pipeline_id,
                   "display_name": (req.query.get("name") or [""])[0],
                   "pipeline_spec": next(yaml.safe_load_all(req.files["uploadfile"]))}
        self.versions[version["pipeline_version_id"]] = version
        return 200, version

    # ----------------------------------------------------------------------- HTTP plumbing

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                url = urlparse(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                req = Recorded(self.command, url.path, parse_qs(url.query), dict(self.headers), body)
                ctype = self.headers.get("Content-Type", "")
                if ctype.startswith("application/json") and body:
                    req.json = json.loads(body)
                elif ctype.startswith("multipart/form-data"):
                    message = email.message_from_bytes(f"Content-Type: {ctype}\r\n\r\n".encode() + body,
                                                       policy=email.policy.HTTP)
                    req.files = {part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
                                 for part in message.iter_parts()}
                with server._lock:
                    server.requests.append(req)
                    status, payload = server.route(req)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _serve

            def log_message(self, *args) -> None:
                pass

        return Handler
