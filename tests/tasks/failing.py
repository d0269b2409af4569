"""A task factory that fails the way ``RELAUNCH_TEST_FAILURE`` names, for the entry points' test: the same
failure raised inside a real step (prepare) and a real training worker (``relaunch.components.train``)."""

from __future__ import annotations

import os


def failure(kind: str) -> BaseException:
    """The exception of ``kind``, each the type a real library raises."""
    if kind == "store-connection":
        from urllib3.exceptions import MaxRetryError

        return MaxRetryError(None, "http://127.0.0.1:9/bucket/key", reason=ConnectionRefusedError(111, "refused"))
    if kind == "mlflow-503":
        from mlflow.exceptions import MlflowException
        from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

        return MlflowException("API request failed with error code 503", error_code=TEMPORARILY_UNAVAILABLE)
    if kind == "keyerror":
        return KeyError("a bug of the task's")
    if kind == "bad-input":
        from relaunch.components.core.contract.errors import BadInput

        return BadInput("train.task: the failing task refuses its configuration")
    raise ValueError(f"RELAUNCH_TEST_FAILURE={kind!r}")


def make_task(config):
    raise failure(os.environ["RELAUNCH_TEST_FAILURE"])
