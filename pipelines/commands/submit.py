"""``relaunch submit --target kfp|argo [--config F] [--set k=v] [--dry-run]``: one pipeline run on a cluster.

    relaunch submit --target argo --config cluster.yaml         # Kubernetes API from KUBECONFIG / in-cluster
    ARGO_SERVER=https://argo:2746 ARGO_TOKEN=... relaunch submit --target argo   # or through the Argo server
    KF_PIPELINES_ENDPOINT=https://kfp relaunch submit --target kfp --param epochs=8

Prints the run's name or id. ``--dry-run`` prints what would be submitted instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import yaml

from ...components.core.contract.config_loading import config_from_cli
from ...components.core.contract.uris import check_http_url
from ...components.core.contract.errors import BadInput
from ...components.launchers.cluster import kube_api_client
from . import Subcommands
from .compile import add_config_args, render, warn_local_services

ARGO = ("argoproj.io", "v1alpha1")
PLURALS = {"Workflow": "workflows", "CronWorkflow": "cronworkflows", "WorkflowTemplate": "workflowtemplates"}


def add_parser(sub: Subcommands, help_text: str) -> None:
    p = sub.add_parser("submit", help=help_text, description=help_text)
    p.add_argument("--target", required=True, choices=["kfp", "argo"])
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="a pipeline parameter (epochs, nodes, inject_failure, ...)")
    p.add_argument("--run-name", help="display name of the run")
    p.add_argument("--namespace", help="namespace (default: launch.kubernetes.namespace)")
    p.add_argument("--endpoint", help="kfp: the Kubeflow Pipelines API (default: $KF_PIPELINES_ENDPOINT)")
    p.add_argument("--dry-run", action="store_true", help="print the document instead of submitting it")
    add_config_args(p)
    p.set_defaults(func=submit_command)


def parse_params(items: list[str]) -> dict[str, str]:
    params = {}
    for item in items:
        if "=" not in item:
            raise BadInput(f"--param {item!r}: expected NAME=VALUE, e.g. --param epochs=8")
        key, value = item.split("=", 1)
        params[key] = value
    return params


def with_parameters(doc: dict, params: dict[str, str]) -> dict:
    """Set workflow parameter values; unknown names are refused (a typo must not be ignored)."""
    spec = doc["spec"]["workflowSpec"] if doc["kind"] == "CronWorkflow" else doc["spec"]
    declared = {p["name"]: p for p in spec["arguments"]["parameters"]}
    for key, value in params.items():
        if key not in declared:
            raise BadInput(f"--param {key}: no such pipeline parameter; known: {', '.join(declared)}")
        declared[key]["value"] = value
    return doc


def create_argo_object(doc: dict, namespace: str, api_client=None) -> str:
    """Create an Argo object through the Argo server (ARGO_SERVER, ARGO_TOKEN) or the Kubernetes API
    (``api_client``, else one from :func:`kube_api_client`)."""
    if os.environ.get("ARGO_SERVER"):
        import requests

        server = os.environ["ARGO_SERVER"].rstrip("/")
        kind = {"Workflow": "workflow", "CronWorkflow": "cronWorkflow"}[doc["kind"]]
        path = {"Workflow": "workflows", "CronWorkflow": "cron-workflows"}[doc["kind"]]
        headers = {"Authorization": f"Bearer {os.environ['ARGO_TOKEN']}"} if os.environ.get("ARGO_TOKEN") else {}
        resp = requests.post(f"{server}/api/v1/{path}/{namespace}", json={kind: doc}, headers=headers,
                             verify=os.environ.get("ARGO_INSECURE_SKIP_VERIFY") != "true", timeout=60)
        if resp.status_code >= 300:
            raise BadInput(f"Argo server refused the {doc['kind']}: {resp.status_code} {resp.text[:300]}")
        return resp.json()["metadata"]["name"]
    from kubernetes import client

    api = client.CustomObjectsApi(api_client or kube_api_client())
    try:
        created = api.create_namespaced_custom_object(*ARGO, namespace, PLURALS[doc["kind"]], doc)
    except client.ApiException as err:
        raise BadInput(f"Kubernetes API refused the {doc['kind']}: {err.status} {err.reason}") from None
    return created["metadata"]["name"]


def submit_command(args: argparse.Namespace) -> int:
    config = config_from_cli(args.config, None, args.overrides)
    if args.target == "argo" and args.run_name and not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?",
                                                                    args.run_name):
        raise BadInput(f"--run-name {args.run_name!r}: an Argo Workflow's name is lowercase a-z, 0-9, '-' and '.' "
                       "(at most 253), e.g. nightly-8-epochs")

    def name_the_run(doc: dict) -> None:
        if args.run_name:
            doc["metadata"].pop("generateName", None)
            doc["metadata"]["name"] = args.run_name

    def submit_to_kfp(kfp_cluster, package: Path, params: dict[str, str]) -> str:
        return kfp_cluster.submit(kfp_cluster.client(kfp_endpoint(args), namespace=args.namespace), package, config,
                                  run_name=args.run_name, arguments=params).run_id

    code = send(args, config, lambda: render("argo", config), submit_to_kfp, customize=name_the_run)
    warn_local_services(config, "the submitted run" if not args.dry_run else "this run")
    return code


def send(args: argparse.Namespace, config, argo_yaml: Callable[[], str],
         kfp_action: Callable[[object, Path, dict[str, str]], str],
         customize: Callable[[dict], None] | None = None) -> int:
    """What submit and schedule share: the Argo document (rendered by ``argo_yaml()``, for that target
    only) straight to the cluster, or the compiled KFP package handed to ``kfp_action(kfp_cluster,
    package, params)``; ``--dry-run`` prints instead."""
    namespace = args.namespace or config.launch.kubernetes.namespace
    params = parse_params(args.param)
    if args.target == "argo":
        # the credentials refused before anything is rendered
        api_client = None if args.dry_run or os.environ.get("ARGO_SERVER") else kube_api_client()
        doc = with_parameters(yaml.safe_load(argo_yaml()), params)
        doc["metadata"]["namespace"] = namespace
        if customize:
            customize(doc)
        if args.dry_run:
            sys.stdout.write(yaml.safe_dump(doc, sort_keys=True, width=1000))
            return 0
        print(create_argo_object(doc, namespace, api_client))
        return 0
    from .. import kfp_cluster

    if not args.dry_run:
        kfp_endpoint(args)  # refused before anything is compiled
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "pipeline.yaml"
        package.write_text(render("kfp", config))
        if args.dry_run:
            sys.stdout.write(package.read_text())
            return 0
        print(_talking_to_kfp(lambda: kfp_action(kfp_cluster, package, params), kfp_endpoint(args)))
    return 0


def kfp_endpoint(args: argparse.Namespace) -> str:
    """The Kubeflow Pipelines API of ``--endpoint`` or ``KF_PIPELINES_ENDPOINT``.

    Raises:
        BadInput: neither is set, or the value is not http(s)://host.
    """
    endpoint = getattr(args, "endpoint", None) or os.environ.get("KF_PIPELINES_ENDPOINT", "")
    if not endpoint:
        raise BadInput(f"{args.command} --target kfp needs the Kubeflow Pipelines API: pass --endpoint "
                       "https://HOST or set KF_PIPELINES_ENDPOINT (--dry-run prints the package instead)")
    try:
        return check_http_url(endpoint, "Kubeflow Pipelines endpoint")
    except ValueError as err:
        raise BadInput(str(err)) from None


def _talking_to_kfp(call: Callable[[], str], endpoint: str) -> str:
    """``call()``, with an unreachable or refusing API server as one line (BadInput) instead of a traceback."""
    import urllib3
    from kfp_server_api.exceptions import ApiException

    try:
        with warnings.catch_warnings():  # kfp.Client's version notice on every call: not the user's concern
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"kfp\.")
            return call()
    except urllib3.exceptions.HTTPError as err:
        reason = getattr(err, "reason", None) or err
        raise BadInput(f"cannot reach the Kubeflow Pipelines API at {endpoint}: {type(reason).__name__}; "
                       "check --endpoint / KF_PIPELINES_ENDPOINT") from None
    except ApiException as err:
        raise BadInput(f"the Kubeflow Pipelines API at {endpoint} refused the request: {err.status} "
                       f"{err.reason}") from None
