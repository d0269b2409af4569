"""classify(exc) -> ExitCode over real failures of each source: minio's S3Error from the moto server (and
through a proxy answering 503 or resetting), MlflowException from real client calls against a real
store and a real HTTP server answering 401/403/503, torch.distributed's errors from a real TCPStore,
and DCP's CheckpointException from real dcp.load calls. No failure is built from a message."""

from __future__ import annotations

import datetime
import http.server
import pickle
import threading

import pytest

from relaunch.components.core.contract.classify import (CarriedError, as_error, classify, classify_pod, dcp_mismatch, dcp_original,
                                      torchrun_exit)
from relaunch.components.core.contract.errors import (BadInput, CorruptCheckpoint, Diverged, Preempted, RelaunchError,
                                    TransientFailure)
from relaunch.components.core.contract.exitcodes import ExitCode
from tests.core.faults import FaultProxy
from tests.services import S3_ACCESS_KEY, S3_SECRET_KEY, free_port

DESIGN_CODES = {1, 2, 3, 137, 138, 143}
"""The non-zero codes of the exit-code table in DESIGN.md."""


def raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - the failure under test
        return err
    raise AssertionError(f"{fn} raised nothing")


# ---------------------------------------------------------------------------------- S3 (minio + moto)


def _minio(endpoint_port: int):
    import urllib3
    from minio import Minio

    # no retries in the client: the test wants the first answer as minio classifies it
    return Minio(f"127.0.0.1:{endpoint_port}", access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY, secure=False,
                 region="us-east-1", http_client=urllib3.PoolManager(retries=False, timeout=5))


def s3_no_such_bucket(s3):
    return raised(lambda: _minio(s3.port).stat_object("no-such-bucket-for-classify", "key"))


def s3_no_such_key(s3):
    s3.create_bucket("classify")
    return raised(lambda: _minio(s3.port).stat_object("classify", "missing-key"))


def _through_proxy(s3, request, **faults):
    proxy = FaultProxy(s3.port, **{"p_reset": 0.0, "p_reset_after": 0.0, "p_slowdown": 0.0, **faults}).start()
    try:
        return raised(lambda: request(_minio(proxy.port)))
    finally:
        proxy.stop()


def s3_slow_down(s3):
    return _through_proxy(s3, lambda c: c.get_object("classify", "key"), p_slowdown=1.0)


def s3_server_error(s3):  # a HEAD has no body to carry an S3 code: minio says ServerError
    return _through_proxy(s3, lambda c: c.stat_object("classify", "key"), p_slowdown=1.0)


def s3_connection_reset(s3):
    return _through_proxy(s3, lambda c: c.stat_object("classify", "key"), p_reset=1.0)


S3_CASES = [("NoSuchBucket", s3_no_such_bucket, ExitCode.BAD_INPUT, "S3Error"),
            ("NoSuchKey", s3_no_such_key, ExitCode.BAD_INPUT, "S3Error"),
            ("503 SlowDown", s3_slow_down, ExitCode.RETRY_ME, "S3Error"),
            ("503 to a HEAD", s3_server_error, ExitCode.RETRY_ME, "ServerError"),
            ("connection reset", s3_connection_reset, ExitCode.RETRY_ME, "ProtocolError")]


@pytest.mark.parametrize("what,make,expected,type_name", S3_CASES, ids=[c[0] for c in S3_CASES])
def test_a_real_s3_failure_is_classified_by_its_s3_code(s3_server, what, make, expected, type_name):
    err = make(s3_server)
    assert type(err).__name__ == type_name, repr(err)
    assert classify(err) == expected
    assert as_error(err, "read an object").exit_code == expected


# ---------------------------------------------------------------------------------- MLflow


class _Answer(http.server.BaseHTTPRequestHandler):
    status = 401

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(self.status)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"Unauthorized" if self.status == 401 else b"nope")

    def log_message(self, *args):
        pass


def _mlflow_against_server_answering(status: int, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    handler = type(f"Answer{status}", (_Answer,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        return raised(lambda: MlflowClient(f"http://127.0.0.1:{server.server_port}").get_run("0" * 32))
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status,expected", [(401, ExitCode.BAD_INPUT), (403, ExitCode.BAD_INPUT),
                                             (503, ExitCode.RETRY_ME)])
def test_a_real_mlflow_answer_is_classified_by_its_error_code_not_its_text(monkeypatch, status, expected):
    from mlflow.exceptions import MlflowException

    from relaunch.components.core.tracking.client import is_auth_error

    err = _mlflow_against_server_answering(status, monkeypatch)
    assert isinstance(err, MlflowException), repr(err)
    assert classify(err) == expected
    assert is_auth_error(err) == (status in (401, 403))


def test_a_missing_run_of_a_real_mlflow_store_is_bad_input_and_an_unreachable_server_is_transient(tmp_path, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.tracking.client import is_auth_error

    missing = raised(lambda: MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run("0" * 32))
    assert isinstance(missing, MlflowException) and missing.error_code == "RESOURCE_DOES_NOT_EXIST"
    assert classify(missing) == ExitCode.BAD_INPUT
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    port = free_port()
    unreachable = raised(lambda: MlflowClient(f"http://127.0.0.1:{port}").get_run("run401"))
    assert classify(unreachable) == ExitCode.RETRY_ME and not is_auth_error(unreachable)


# ---------------------------------------------------------------------------------- torch.distributed


def test_real_torch_distributed_failures_are_transient():
    import torch.distributed as dist

    second = datetime.timedelta(seconds=1)
    nobody = raised(lambda: dist.TCPStore("127.0.0.1", free_port(), 2, is_master=False, timeout=second))
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=second)
    never_set = raised(lambda: store.get("a key nobody sets"))
    assert (type(nobody), type(never_set)) == (dist.DistNetworkError, dist.DistStoreError)
    for err in (nobody, never_set):
        assert classify(err) == ExitCode.RETRY_ME
        assert isinstance(as_error(err), TransientFailure)


# ---------------------------------------------------------------------------------- DCP


@pytest.fixture
def saved(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    dcp.save({"w": torch.zeros(3)}, checkpoint_id=str(folder))
    return folder


def _load_raising(folder, error: BaseException) -> BaseException:
    """A real dcp.load whose storage reader (DCP's plug-in point for a store) raises ``error``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    class FailingReader(FileSystemReader):
        def read_data(self, plan, planner):
            raise error

    return raised(lambda: dcp.load({"w": torch.zeros(3)}, storage_reader=FailingReader(str(folder))))


@pytest.mark.parametrize("original,expected", [
    (CorruptCheckpoint("chunk 0 of step-10 fails its digest"), ExitCode.BAD_INPUT),
    (TransientFailure("S3 read failed 8 times"), ExitCode.RETRY_ME),
    (BadInput("checkpoint of another run"), ExitCode.BAD_INPUT),
])
def test_a_real_dcp_checkpoint_exception_is_classified_as_the_error_it_wraps(saved, original, expected):
    from torch.distributed.checkpoint.api import CheckpointException

    err = _load_raising(saved, original)
    assert isinstance(err, CheckpointException)
    assert classify(err) == expected
    assert dcp_original(err) is original and as_error(err) is original


def test_a_dcp_failure_of_a_foreign_error_is_a_bug_and_a_missing_file_too(saved):
    import torch
    import torch.distributed.checkpoint as dcp

    for f in saved.glob("*.distcp"):
        f.unlink()
    err = raised(lambda: dcp.load({"w": torch.zeros(3)}, checkpoint_id=str(saved)))
    assert isinstance(dcp_original(err), FileNotFoundError)
    assert classify(err) == ExitCode.BUG


def test_a_checkpoint_of_another_model_is_found_from_the_metadata_not_from_dcps_message(saved):
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(saved)).read_metadata()
    assert dcp_mismatch({"w": torch.zeros(3)}, metadata) is None
    assert dcp_mismatch({"w": torch.zeros(4)}, metadata) == "w is (3,) in the checkpoint, (4,) here"
    assert dcp_mismatch({"w": torch.zeros(3), "bias": torch.zeros(1)}, metadata) == "the checkpoint has no bias"


# ---------------------------------------------------------------------------------- the Kubernetes API


@pytest.mark.parametrize("status,expected", [(401, ExitCode.BAD_INPUT), (403, ExitCode.BAD_INPUT),
                                             (422, ExitCode.BAD_INPUT), (409, ExitCode.RETRY_ME),
                                             (429, ExitCode.RETRY_ME), (503, ExitCode.RETRY_ME)])
def test_a_kubernetes_api_answer_is_classified_by_its_status(status, expected):
    from kubernetes.client import ApiException

    assert classify(ApiException(status=status, reason="as the API server says")) == expected


# ---------------------------------------------------------------------------------- the contract, Python


@pytest.mark.parametrize("err,expected", [
    (BadInput("x"), ExitCode.BAD_INPUT), (CorruptCheckpoint("x"), ExitCode.BAD_INPUT),
    (Diverged("x"), ExitCode.DIVERGED), (Preempted("x"), ExitCode.PREEMPTED),
    (TransientFailure("x"), ExitCode.RETRY_ME), (RelaunchError("x"), ExitCode.BUG),
    (KeyboardInterrupt(), ExitCode.INTERRUPTED), (ConnectionRefusedError(), ExitCode.RETRY_ME),
    (TimeoutError(), ExitCode.RETRY_ME), (ValueError("401 Unauthorized"), ExitCode.BUG),
])
def test_the_contracts_errors_carry_their_code_and_anything_unknown_is_a_bug(err, expected):
    assert classify(err) == expected


# ---------------------------------------------------------------------------------- statuses


def _pod(name="w-0", reason=None, exit_code=None, term_reason=None, container="node"):
    status = {"reason": reason} if reason else {}
    if exit_code is not None:
        status["containerStatuses"] = [{"name": container, "state": {"terminated": {"exitCode": exit_code,
                                                                                     "reason": term_reason}}}]
    return {"metadata": {"name": name}, "status": status}


@pytest.mark.parametrize("pod,expected", [
    (_pod(exit_code=137, term_reason="OOMKilled"), [ExitCode.KILLED]),
    (_pod(exit_code=1, term_reason="OOMKilled"), [ExitCode.KILLED]),  # OOM whatever the runtime said
    (_pod(reason="Evicted"), [ExitCode.PREEMPTED]),
    (_pod(exit_code=2, term_reason="Error"), [ExitCode.BAD_INPUT]),
    (_pod(exit_code=3, term_reason="Error"), [ExitCode.DIVERGED]),
    (_pod(exit_code=138, term_reason="Error"), [ExitCode.RETRY_ME]),
    (_pod(exit_code=143, term_reason="Error"), [ExitCode.PREEMPTED]),
    (_pod(exit_code=0, term_reason="Completed"), []),
    (_pod(exit_code=2, container="sidecar"), []),
])
def test_a_pods_status_is_classified_by_reason_and_exit_code(pod, expected):
    assert [code for code, _ in classify_pod(pod, "node")] == expected


@pytest.mark.parametrize("returncode,record,expected", [
    (0, None, 0), (-9, None, 137), (-15, None, 143), (1, None, 137),
    (1, {"exit_code": 3, "time": 10.0}, 3), (1, {"exit_code": 2, "time": 1.0}, 137),
    # torchrun aborting in its own shutdown after a preemption the training recorded (seen in CI's cold lane)
    (-6, {"exit_code": 143, "time": 10.0}, 143), (-6, None, 134), (-6, {"exit_code": 143, "time": 1.0}, 134),
    (-11, {"exit_code": 2, "time": 10.0}, 2), (-15, {"exit_code": 2, "time": 10.0}, 143),
])
def test_torchruns_status_has_one_mapping(returncode, record, expected):
    assert torchrun_exit(returncode, record, started_at=5.0) == expected


def test_every_code_of_the_design_table_comes_out_of_a_real_source():
    reached = {int(code) for _, _, code, _ in S3_CASES} | {ExitCode.BUG, ExitCode.DIVERGED}
    reached |= {torchrun_exit(-9, None, 0.0), torchrun_exit(-15, None, 0.0)}
    assert DESIGN_CODES <= reached


# ---------------------------------------------------------------------------------- across ranks


class LostRace(BadInput):
    """A contract error that code catches by type (as storage's PreconditionFailed)."""

    kind = "test-lost-race"


@pytest.mark.parametrize("err,cls,code", [
    (CorruptCheckpoint("chunk 3 fails its digest"), CorruptCheckpoint, 2),
    (LostRace("latest.json changed"), LostRace, 2),
    (TransientFailure("S3 away"), TransientFailure, 138),
    (Diverged("nan"), Diverged, 3),
    (ValueError("a bug"), RelaunchError, 1),
])
def test_an_error_carried_to_another_rank_is_rebuilt_from_its_kind_and_exit_code(err, cls, code):
    carried = pickle.loads(pickle.dumps(CarriedError.of(err)))  # what all_gather_object does
    again = carried.rebuild("rank 1: ")
    assert type(again) is cls and again.exit_code == code and str(again).startswith("rank 1: ")


def test_a_carried_kind_whose_exit_code_differs_is_rebuilt_from_the_code():
    again = CarriedError(138, "corrupt-checkpoint", "older peer").rebuild()
    assert type(again) is TransientFailure and again.exit_code == 138


def test_a_peer_of_a_killed_worker_is_137_by_its_type_and_stays_so_when_carried_to_another_rank():
    from relaunch.components.core.contract.classify import CarriedError, classify
    from relaunch.components.core.contract.exitcodes import ExitCode
    from relaunch.components.train import PeerFailure

    err = PeerFailure(RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert classify(err) == ExitCode.KILLED and "gloo" not in str(err)
    again = CarriedError.of(err).rebuild()
    assert isinstance(again, PeerFailure) and again.exit_code == ExitCode.KILLED
