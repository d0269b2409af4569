"""URIs and paths as the configuration takes them: a leading ``~`` expanded, MLflow tracking URIs,
artifact locations, http(s) endpoints and registered model URIs checked, each refusal one line naming
the fix. The schema's validators (:mod:`relaunch.components.core.contract.config`) call them; so do the
commands that take a path or a URI outside the configuration. A store URI's rule is the store's own
(:func:`relaunch.components.core.contract.registry.parse_store_uri`).
"""

from __future__ import annotations

import os
import re

MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[A-Za-z0-9_-]+))$")
"""A registered model version: ``models:/name/version`` or ``models:/name@alias``."""


def expand_home(path: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded to that home directory (as a shell would:
    a quoted ``--set store.uri=~/x`` must not become a folder named ``~``); other paths unchanged.

    Raises:
        ValueError: the ``~`` cannot be expanded (no such user, or no HOME).
    """
    if not path.startswith("~"):
        return path
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):
        raise ValueError(f"{path!r}: cannot expand {path.split('/', 1)[0]!r} (no such user, or HOME unset); "
                         f"write the absolute path")
    return expanded


TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "file", "databricks")
"""Tracking URI schemes MLflow serves (a database one may name its driver: ``postgresql+psycopg2``)."""
_URI_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(.*)$", re.S)


def check_tracking_uri(uri: str) -> str:
    """``uri`` if it is a well-formed MLflow tracking URI, else ValueError naming the fix in one line:
    ``sqlite:x.db`` -> ``sqlite:///x.db``, ``http:/host`` -> ``http://host``, ``HTTP://`` -> lowercase,
    no credentials in it (they come from MLFLOW_TRACKING_USERNAME/PASSWORD)."""
    usage = "use sqlite:///path.db, postgresql+psycopg2://..., or http://host:port"
    for scheme in ("sqlite:///", "file://"):  # a path after the scheme: ~ expanded, as in store.uri
        if uri.startswith(scheme + "~"):
            uri = scheme + expand_home(uri[len(scheme):])
    match = _URI_PREFIX.match(uri)
    if match is None:
        raise ValueError(f"unsupported tracking URI {uri!r} (a path is not one); {usage}")
    scheme, rest = match[1], match[2]
    base = scheme.split("+")[0].lower()
    if base not in TRACKING_SCHEMES:
        raise ValueError(f"unsupported tracking URI {uri!r}: scheme {scheme!r}; {usage}")
    if scheme != scheme.lower():
        raise ValueError(f"tracking URI {uri!r}: write the scheme in lowercase: {scheme.lower()}:{rest}")
    if not rest.startswith("//"):
        slashes = "///" if base in ("sqlite", "file") else "//"
        raise ValueError(f"tracking URI {uri!r} is not a well-formed {base} URI; write the URI as "
                         f"{scheme}:{slashes}{rest.lstrip('/')}")
    if base == "sqlite" and not rest.startswith("///"):
        raise ValueError(f"tracking URI {uri!r}: a sqlite URI has three slashes before the file: "
                         f"sqlite:///{rest.lstrip('/')} (relative) or sqlite:////absolute/path.db")
    if base in ("http", "https") and not rest[2:].split("/", 1)[0]:
        raise ValueError(f"tracking URI {uri!r} names no host; write {base}://host:port")
    if re.match(r"^https?://[^/]*:[^/@]*@", uri):
        raise ValueError("tracking URI must not carry credentials; set MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD")
    return uri


def check_artifact_location(uri: str) -> str:
    """``uri`` if it is a path or ``<scheme>://...`` (``mlflow-artifacts:/path`` too), else ValueError:
    ``s3:/bucket/x`` would be taken as a local folder of that name."""
    match = _URI_PREFIX.match(uri)
    if match is None:
        return expand_home(uri)
    if match[1] == "mlflow-artifacts":
        return uri
    scheme, rest = match[1], match[2]
    if scheme != scheme.lower():
        raise ValueError(f"artifact location {uri!r}: write the scheme in lowercase: {scheme.lower()}:{rest}")
    if not rest.startswith("//"):
        slashes = "///" if scheme == "file" else "//"
        raise ValueError(f"artifact location {uri!r} is not a well-formed URI; write the URI as "
                         f"{scheme}:{slashes}{rest.lstrip('/')} (a local directory of that name is written ./{uri})")
    return uri


def check_http_url(url: str, what: str) -> str:
    """``url`` if it is ``http(s)://host[:port][/...]``, else ValueError naming ``what``."""
    if not re.match(r"^https?://[^/\s]+", url):
        raise ValueError(f"{what} {url!r} is not http(s)://host[:port]")
    return url
