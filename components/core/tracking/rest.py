"""MLflow's public REST API (``/api/2.0/mlflow/...``, https://mlflow.org/docs/latest/rest-api.html) over
one kept-alive connection, for the run logger's thread.

MLflow's own client costs ~1.6 ms of CPU per request (request-header providers, a retrying requests
session, entity -> protobuf -> JSON), on a thread that shares the GIL with the training loop; a plain
``http.client`` request with a JSON body costs a tenth of that. The credentials are MLflow's: the
same :func:`mlflow.utils.credentials.get_default_host_creds` (``MLFLOW_TRACKING_USERNAME`` and
``_PASSWORD``, ``MLFLOW_TRACKING_TOKEN``, ``~/.mlflow/credentials``, ``MLFLOW_TRACKING_INSECURE_TLS``,
``MLFLOW_TRACKING_SERVER_CERT_PATH``, ``MLFLOW_TRACKING_CLIENT_CERT_PATH``), put on the request as
MLflow's ``http_request`` puts them. What this path does not reproduce (AWS SigV4, an auth plugin,
the Databricks SDK, an MLflow workspace, an HTTP proxy from the environment) goes through MLflow's
``http_request`` instead. An answer other than 200 raises what MLflow's client raises for it
(``verify_rest_response``), so the error classification is the same on both paths.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import time
import urllib.parse
import urllib.request
from typing import Any

LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
GET_RUN = "/api/2.0/mlflow/runs/get"
UPDATE_RUN = "/api/2.0/mlflow/runs/update"
IDLE_SECONDS = 1.0  # a connection idle longer is reopened: servers close idle keep-alive ones (uvicorn after 5 s)


class _Answer:
    """What ``verify_rest_response`` reads of a response (a requests.Response's ``status_code`` and ``text``)."""

    def __init__(self, status_code: int, text: str):
        self.status_code, self.text = status_code, text


def _timeout() -> float:
    try:
        return float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "120"))
    except ValueError:
        return 120.0


def _uses_proxy(parsed: urllib.parse.SplitResult) -> bool:
    proxies = urllib.request.getproxies()
    return (parsed.scheme in proxies or "all" in proxies) and not urllib.request.proxy_bypass(parsed.hostname or "")


def _tls_context(host_creds) -> ssl.SSLContext:
    """The verification requests does for MLflow: none when insecure, the given CA file, else
    REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE / certifi's bundle; plus the client certificate when given."""
    if host_creds.ignore_tls_verification and not host_creds.server_cert_path:  # MlflowHostCreds.verify's order
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        cafile = (host_creds.server_cert_path or os.environ.get("REQUESTS_CA_BUNDLE")
                  or os.environ.get("CURL_CA_BUNDLE"))
        if not cafile:
            import certifi

            cafile = certifi.where()
        context = ssl.create_default_context(cafile=cafile if os.path.isfile(cafile) else None,
                                             capath=cafile if os.path.isdir(cafile) else None)
    if host_creds.client_cert_path:
        context.load_cert_chain(host_creds.client_cert_path)
    return context


class RestSession:
    """Requests to one MLflow tracking server over one connection (one thread's)."""

    def __init__(self, uri: str):
        from mlflow.utils.credentials import get_default_host_creds

        self.uri = uri.rstrip("/")
        self.host_creds = get_default_host_creds(self.uri)  # parses ~/.mlflow/credentials: once
        self.timeout = _timeout()
        self._parsed = urllib.parse.urlsplit(self.uri)
        self._prefix = self._parsed.path.rstrip("/")
        self._conn: http.client.HTTPConnection | None = None
        self._used = 0.0
        self.requests = 0
        self._headers = {"Content-Type": "application/json"}
        self.plain = self._plain_possible()
        if self.plain:
            creds = self.host_creds
            if creds.username and creds.password:
                basic = base64.standard_b64encode(f"{creds.username}:{creds.password}".encode()).decode()
                self._headers["Authorization"] = f"Basic {basic}"
            elif creds.token:
                self._headers["Authorization"] = f"Bearer {creds.token}"

    def _plain_possible(self) -> bool:
        """Whether a plain request carries exactly what MLflow's client would send (else its path is used)."""
        creds = self.host_creds
        if self._parsed.scheme not in ("http", "https") or not self._parsed.hostname:
            return False
        if creds.aws_sigv4 or creds.auth or getattr(creds, "use_databricks_sdk", False) \
                or getattr(creds, "client_secret", None):
            return False
        try:
            from mlflow.utils.workspace_context import get_request_workspace

            if get_request_workspace():
                return False
        except ImportError:
            pass
        return not _uses_proxy(self._parsed)

    # ---- the calls

    def post(self, endpoint: str, body: dict[str, Any] | str) -> dict[str, Any]:
        """POST ``endpoint`` (``/api/2.0/mlflow/...``) with a JSON body (a dict, or a JSON string already made)."""
        return self._request("POST", endpoint, body if isinstance(body, str) else json.dumps(body))

    def get(self, endpoint: str, **query: str) -> dict[str, Any]:
        """GET ``endpoint?<query>``."""
        return self._request("GET", endpoint, None, query)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ---- one request

    def _request(self, verb: str, endpoint: str, body: str | None, query: dict | None = None) -> dict[str, Any]:
        self.requests += 1
        if not self.plain:
            return self._through_mlflow(verb, endpoint, body, query)
        path = self._prefix + endpoint + ("?" + urllib.parse.urlencode(query) if query else "")
        if self._conn is not None and time.monotonic() - self._used > IDLE_SECONDS:
            self.close()
        conn = self._conn or self._connect()
        try:
            conn.request(verb, path, body=body.encode() if body is not None else None, headers=self._headers)
            response = conn.getresponse()
            status, text = response.status, response.read().decode("utf-8", "replace")
        except BaseException:
            self.close()  # the connection's state is unknown: the next request opens another
            raise
        self._used = time.monotonic()
        if response.will_close:
            self.close()
        return self._verified(status, text, endpoint)

    def _connect(self) -> http.client.HTTPConnection:
        host, port = self._parsed.hostname, self._parsed.port
        if self._parsed.scheme == "https":
            self._conn = http.client.HTTPSConnection(host, port, timeout=self.timeout,
                                                     context=_tls_context(self.host_creds))
        else:
            self._conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
        return self._conn

    @staticmethod
    def _verified(status: int, text: str, endpoint: str) -> dict[str, Any]:
        if status != 200:
            from mlflow.utils.rest_utils import verify_rest_response

            verify_rest_response(_Answer(status, text), endpoint)  # raises MLflow's error for this answer
        return json.loads(text) if text.strip() else {}

    def _through_mlflow(self, verb: str, endpoint: str, body: str | None, query: dict | None) -> dict[str, Any]:
        from mlflow.utils.rest_utils import http_request, verify_rest_response

        kwargs: dict[str, Any] = {"params": query} if verb == "GET" else {
            "data": body, "extra_headers": {"Content-Type": "application/json"}}
        response = http_request(self.host_creds, endpoint, verb, **kwargs)
        verify_rest_response(response, endpoint)
        return json.loads(response.text) if response.text.strip() else {}
