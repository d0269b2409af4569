"""``relaunch run`` refuses bad input before anything starts: one line on stderr naming what is wrong,
exit code 2, and nothing in the store deleted or overwritten. One table, across the configuration,
the command line, store URIs and tracking URIs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from relaunch.pipelines.cli import main
from tests.services import free_port
from tests.train.test_bad_input import authenticating_s3  # noqa: F401 - a moto that checks signatures

CLOSED = free_port()  # nothing listens there


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A store holding a committed checkpoint of the default model, one of another model, and debris."""
    from relaunch.components.core.checkpoint import CheckpointManager
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.trainer.state import TrainingState
    from relaunch.components.tasks.base import load_task

    root = tmp_path_factory.mktemp("bad-inputs") / "store"
    config = RelaunchConfig()
    mgr = CheckpointManager(str(root), keep_last=5, async_save=False)
    torch.manual_seed(0)
    mgr.save(5, TrainingState(load_task(config.train.task, config).build_model()))
    other = RelaunchConfig.model_validate({"train": {"hidden_size": 3}})
    foreign = CheckpointManager(str(root.parent / "foreign"), async_save=False)
    foreign.save(7, TrainingState(load_task(other.train.task, other).build_model()))
    junk = root / "checkpoints" / "step-000000000009"
    junk.mkdir(parents=True)
    (junk / "model.bin").write_bytes(b"not a checkpoint")
    return root


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def _yaml(tmp: Path, text: str) -> str:
    path = tmp / "bad.yaml"
    path.write_text(text)
    return str(path)


S3_HALF_CREDENTIALS = {"AWS_SECRET_ACCESS_KEY": None, "MINIO_SECRET_KEY": None}
CASES = [
    # (id, argv after "run", environment changes, what the line must say)
    ("negative-epochs", ["--set", "train.epochs=-1"], {}, "train.epochs"),
    ("epochs-not-a-number", ["--set", "train.epochs=abc"], {}, "train.epochs"),
    ("nodes-zero", ["--set", "launch.nodes=0"], {}, "launch.nodes"),
    ("procs-zero", ["--set", "launch.procs_per_node=0"], {}, "launch.procs_per_node"),
    ("negative-batch", ["--set", "train.global_batch_size=-5"], {}, "train.global_batch_size"),
    ("zero-lr", ["--set", "train.lr=0"], {}, "train.lr"),
    ("val-fraction-too-big", ["--set", "data.val_fraction=0.9"], {}, "data.val_fraction"),
    ("unknown-section", ["--set", "nosuch.key=1"], {}, "unknown key 'nosuch'"),
    ("unknown-key", ["--set", "train.nosuch=1"], {}, "unknown key 'train.nosuch'"),
    ("set-without-equals", ["--set", "train.epochs"], {}, "expected dotted.key=value"),
    ("set-empty-key", ["--set", "=3"], {}, "empty key segment"),
    ("set-into-a-value", ["--set", "train.epochs.x=1"], {}, "train.epochs"),
    ("task-module-missing", ["--set", "train.task=nosuchmodule:make_task"], {}, "cannot import module 'nosuchmodule'"),
    ("task-factory-missing", ["--set", "train.task=relaunch.components.tasks.digits:nosuch"], {}, "no callable 'nosuch'"),
    ("task-not-a-spec", ["--set", "train.task=notaspec"], {}, "is not package.module:factory"),
    ("task-not-a-task", ["--set", "train.task=collections:OrderedDict"], {}, "without build_model"),
    ("batch-not-split-into-micro-batches", ["--set", "train.grad_accum_steps=3"], {},
     "train.global_batch_size=64 does not split into train.grad_accum_steps=3 micro-batches on each of 2 ranks"),
    ("task-option-the-task-does-not-read", ["--set", "train.task_options.dropout=0.1"], {},
     "train.task_options.dropout: the task relaunch.components.tasks.digits:make_task does not read this option (it reads none)"),
    ("name-not-kebab", ["--set", "name=Bad_Name"], {}, "name"),
    ("backend-unknown", ["--set", "launch.backend=slurm"], {}, "launch.backend"),
    ("failure-spec-unknown", ["--inject-failure", "explode@step=3"], {}, "is not a failure spec"),
    ("failure-step-not-a-number", ["--inject-failure", "kill-worker@step=x"], {}, "is not a failure spec"),
    ("min-nodes-above-nodes", ["--set", "launch.min_nodes=5"], {}, "min_nodes=5 exceeds nodes=2"),
    ("batch-not-divisible-by-the-world-size", ["--set", "launch.nodes=3"], {},
     "train.global_batch_size=64 is not divisible by the world size 3"),
    ("port-out-of-range", ["--set", "launch.rdzv_port=70000"], {}, "launch.rdzv_port"),
    ("evaluate-checkpoint-unknown", ["--set", "evaluate.checkpoint=worst"], {}, "evaluate.checkpoint"),
    ("negative-margin", ["--set", "registry.champion_margin=-1"], {}, "registry.champion_margin"),
    ("bool-not-a-bool", ["--set", "train.deterministic=maybe"], {}, "train.deterministic"),
    ("negative-restarts", ["--set", "launch.max_restarts=-1"], {}, "launch.max_restarts"),
    ("zero-max-steps", ["--set", "train.max_steps=0"], {}, "train.max_steps"),
    ("section-given-a-scalar", ["--set", "train=3"], {}, "train"),
    ("config-file-missing", ["--config", "/nonexistent/relaunch.yaml"], {}, "does not exist"),
    ("config-file-bad-yaml", ["--config", "YAML:train: [1, 2"], {}, "is not valid YAML"),
    ("config-file-a-list", ["--config", "YAML:- 1\n- 2\n"], {}, "must hold a mapping"),
    ("config-file-unknown-key", ["--config", "YAML:train:\n  epoch: 3\n"], {}, "unknown key 'train.epoch'"),
    ("cli-unknown-option", ["--bogus"], {}, "unrecognized arguments"),
    ("store-scheme-unknown", ["--set", "store.uri=ftp://host/x"], {}, "store.uri"),
    ("store-s3-no-bucket", ["--set", "store.uri=s3:///prefix"], {}, "no bucket"),
    ("store-s3-credentials-in-uri", ["--set", "store.uri=s3://user:pw@bucket/x"], {}, "must not carry credentials"),
    ("store-empty", ["--set", "store.uri="], {}, "store.uri"),
    ("store-s3-bad-bucket-name", ["--set", "store.uri=s3://Bad_Bucket/x"], {"S3": 1}, "is invalid"),
    ("store-s3-missing-bucket", ["--set", "store.uri=s3://no-such-bucket/x"], {"S3": 1}, "does not exist"),
    ("store-s3-wrong-credentials", ["--set", "store.uri=s3://guarded/x"], {"AUTH": 1}, "refused"),
    ("store-s3-incomplete-credentials", ["--set", "store.uri=s3://relaunch-bad/x"], {"S3": 1, **S3_HALF_CREDENTIALS},
     "credentials incomplete"),
    ("store-s3-unreachable", ["--set", "store.uri=s3://relaunch-bad/x"],
     {"S3": 1, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{CLOSED}"}, "cannot be reached"),
    ("store-s3-no-endpoint", ["--set", "store.uri=s3://relaunch-bad/x"], {"S3": 1, "AWS_ENDPOINT_URL": None},
     "needs an endpoint"),
    ("store-s3-malformed-endpoint", ["--set", "store.uri=s3://relaunch-bad/x"], {"S3": 1, "AWS_ENDPOINT_URL": "ftp://x"},
     "is not http(s)://host[:port]"),
    ("store-file-uri-with-host", ["--set", "store.uri=file://host/x"], {}, "file:///absolute/path"),
    ("store-s3-uri-missing-its-slashes", ["--set", "store.uri=s3:/bucket/x"], {}, "write the URI as s3://bucket/x"),
    ("store-s3-uri-without-slashes", ["--set", "store.uri=s3:bucket/x"], {}, "write the URI as s3://bucket/x"),
    ("store-s3-uri-in-capitals", ["--set", "store.uri=S3://bucket/x"], {}, "lowercase: s3://bucket/x"),
    ("store-file-uri-of-a-relative-path", ["--set", "store.uri=file:relative"], {}, "without file:"),
    ("store-unsupported-scheme-as-a-path", ["--set", "store.uri=hdfs:bucket/x"], {}, "hdfs is not supported"),
    ("store-any-scheme-like-prefix", ["--set", "store.uri=foo:bar"], {}, "write ./foo:bar"),
    ("tracking-sqlite-missing-its-slashes", ["--set", "tracking.uri=sqlite:x.db"], {}, "write the URI as sqlite:///x.db"),
    ("tracking-http-missing-a-slash", ["--set", "tracking.uri=http:/mlflow:5000"], {}, "write the URI as http://mlflow:5000"),
    ("artifacts-s3-missing-a-slash", ["--set", "tracking.artifact_location=s3:/b/x"], {}, "write the URI as s3://b/x"),
    ("unknown-key-gets-a-guess", ["--set", "train.epoch=3"], {}, "did you mean 'train.epochs'?"),
    ("tracking-scheme-unknown", ["--set", "tracking.uri=mongodb://x"], {}, "unsupported tracking URI"),
    ("tracking-credentials-in-uri", ["--set", "tracking.uri=http://u:p@127.0.0.1:5000"], {}, "must not carry credentials"),
    ("tracking-unreachable", ["--set", f"tracking.uri=http://127.0.0.1:{CLOSED}"], {}, "cannot reach the MLflow server"),
    ("tracking-postgres-unreachable", ["--set", f"tracking.uri=postgresql+psycopg2://u@127.0.0.1:{CLOSED}/db"], {},
     "cannot connect to the tracking database"),
    ("tracking-sqlite-under-a-file", ["--set", "tracking.uri=sqlite:////etc/hostname/x/mlflow.db"], {}, "cannot create"),
    ("tracking-env-overrides-unreachable", [], {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{CLOSED}"}, "cannot reach"),
    ("resume-without-a-training", ["--resume"], {}, "holds no training to resume"),
    ("resume-from-not-a-checkpoint-uri", ["--set", "train.resume_from=/tmp/elsewhere"], {}, "is not a checkpoint URI"),
    ("resume-from-uncommitted-debris", ["--set", "train.resume_from=STORE/checkpoints/step-000000000009"], {},
     "is not a committed relaunch checkpoint"),
    ("resume-from-missing-step", ["--set", "train.resume_from=STORE/checkpoints/step-000000000042"], {},
     "is not a committed relaunch checkpoint"),
    ("resume-from-foreign-model", ["--set", "train.resume_from=FOREIGN/checkpoints/step-000000000007"], {},
     "holds another model"),
    ("warm-start-malformed", ["--set", "train.warm_start_model=runs:/abc/model"], {}, "is not models:/name/version"),
]


@pytest.mark.parametrize("argv, env, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_the_store_alone(argv, env, expected, store, tmp_path, monkeypatch,
                                                                 capsys, request):
    env = dict(env)
    if env.pop("S3", None):
        request.getfixturevalue("s3_env").create_bucket("relaunch-bad")
    if env.pop("AUTH", None):
        env.update({**request.getfixturevalue("authenticating_s3"), "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("STORE", str(store)).replace("FOREIGN", str(store.parent / "foreign")) for a in argv]
    argv = [_yaml(tmp_path, a.removeprefix("YAML:")) if a.startswith("YAML:") else a for a in argv]
    if not any(a.startswith("store.uri=") for a in argv):
        argv += ["--set", f"store.uri={store}"]
    before = _snapshot(store)
    with pytest.raises(SystemExit) if "--bogus" in argv else _nothing():
        code = main(["run", *argv])
    if "--bogus" in argv:
        code = 2
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1, err
    assert expected in err[0]
    assert _snapshot(store) == before
    assert not (tmp_path / ".relaunch" / "runs").exists(), "the pipeline must not have started"


def test_the_table_holds_at_least_forty_cases():
    assert len(CASES) >= 40


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
