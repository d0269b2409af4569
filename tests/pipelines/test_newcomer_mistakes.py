"""A script of the mistakes a newcomer makes in the first hour, run through the real ``relaunch`` CLI as
subprocesses (the way a person types them) in a directory where ``relaunch run`` already left a
training: each one is a single line on stderr, exit code 2, and the store and ``.relaunch/`` are
exactly as they were (nothing started, nothing written, nothing deleted)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.services import free_port

REPO = Path(__file__).resolve().parents[2]
CLOSED = free_port()  # nothing listens there
TRAINING = "20261204-030015"

SCRIPT = [
    # (what the newcomer typed after `relaunch`, what the one line must say)
    ("run --set store.uri=s3:/bucket/x", "write the URI as s3://bucket/x"),
    ("run --set store.uri=s3:bucket/x", "write the URI as s3://bucket/x"),
    ("run --set store.uri=S3://bucket/x", "lowercase"),
    ("run --set store.uri=file:my-store", "without file:"),
    ("run --set store.uri=mystore:v2", "./mystore:v2"),
    ("run --set store.uri=ftp://host/x", "is not supported"),
    ("run --set tracking.uri=sqlite:mlflow.db", "sqlite:///mlflow.db"),
    ("run --set tracking.uri=http:/mlflow:5000", "http://mlflow:5000"),
    ("run --set train.epoch=8", "did you mean 'train.epochs'?"),
    ("run --set trian.epochs=8", "did you mean 'train'?"),
    ("run --set train.epochs=-1", "train.epochs"),
    ("run --set train.epochs=eight", "train.epochs"),
    ("run --set launch.nodes=0", "launch.nodes"),
    ("run --set train.global_batch_size=63", "not divisible by the world size"),
    ("run --set train.task=mypkg.mytask:make_task", "cannot import module 'mypkg.mytask'"),
    ("run --set train.resume_from=./somewhere", "is not a checkpoint URI"),
    ("run --inject-failure kill-worker@30", "is not a failure spec"),
    ("run --config configs/nosuch.yaml", "does not exist"),
    ("run --config bad.yaml", "is not valid YAML"),
    ("run --epochs 8", "unrecognized arguments"),
    ("run --resume --set store.uri=./empty-store", "holds no training to resume"),
    ("rn", "did you mean 'run'?"),
    ("compile --target kpf", "did you mean 'kfp'?"),
    ("compile --target kfp -o /nonexistent/dir/p.yaml", "does not exist"),
    ("compile --target argo -o .", "cannot write it"),
    ("submit --target kfp", "KF_PIPELINES_ENDPOINT"),
    (f"submit --target kfp --endpoint http://127.0.0.1:{CLOSED}", "cannot reach the Kubeflow Pipelines API"),
    ("submit --target kfp --endpoint kfp.example.com", "is not http(s)://host"),
    ("submit --target argo", "no Kubernetes credentials"),
    ("submit --target argo --dry-run --param epoch=8", "no such pipeline parameter"),
    ("submit --target argo --dry-run --run-name My_Run", "an Argo Workflow's name is lowercase"),
    ("schedule --target argo --cron @daily", "expected five fields"),
    ("render trainjob --set launch.trainjob.runtime=Relaunch_Torch", "is not a DNS label"),
    ("render volcanojob", "invalid choice"),
    ("checkpoints list --store ./relaunch/store", "no such directory"),
    ("checkpoints lst --store .relaunch/store", "did you mean 'list'?"),
    ("checkpoints list --store .relaunch/store --training 20261204-030016", f"did you mean '{TRAINING}'?"),
    ("checkpoints verify --store .relaunch/store --step 7", "step-000000000007"),
    ("checkpoints latest --store s3:/bucket/x", "write the URI as s3://bucket/x"),
    ("checkpoints export --store .relaunch/store", "export needs --to FILE"),
]


def _tree(root: Path) -> dict[str, str]:
    """Every file's digest and every folder under ``root``: what "nothing changed" compares."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A directory as `relaunch run` leaves it: a training with committed checkpoints under
    .relaunch/store/trainings/<time>/, an empty store beside it, and a YAML file with a typo."""
    from relaunch.components.core.checkpoint import CheckpointManager
    from tests.core.helpers import make_state, train_steps

    work = tmp_path_factory.mktemp("newcomer")
    mgr = CheckpointManager(str(work / ".relaunch" / "store" / "trainings" / TRAINING), keep_last=0,
                            async_save=False)
    state = make_state()
    for step in (20, 40):
        train_steps(state, 1)
        mgr.save(step, state, metrics={"val_loss": 0.5})
    mgr.close()
    (work / "empty-store").mkdir()
    (work / "bad.yaml").write_text("train:\n  epochs: [4\n")
    return work


def _typed(line: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "MINIO_", "MLFLOW_", "KF_PIPELINES", "ARGO_", "KUBE"))}
    env.update(PYTHONPATH=str(REPO), HOME=str(cwd), KUBECONFIG=str(cwd / "no-kubeconfig"), COLUMNS="80")
    return subprocess.run([sys.executable, "-m", "relaunch.pipelines.cli", *line.split()], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_every_newcomer_mistake_is_one_line_exit_2_and_changes_nothing(workdir):
    before = _tree(workdir)
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda case: (case, _typed(case[0], workdir)), SCRIPT))
    wrong = []
    for (line, expected), proc in done:
        err = proc.stderr.strip().splitlines()
        if proc.returncode != 2 or len(err) != 1 or expected not in err[0]:
            wrong.append(f"relaunch {line}: exit {proc.returncode}, stderr {err[-3:]!r}")
    assert not wrong, "\n".join(wrong)
    assert _tree(workdir) == before, "a mistake changed the directory"


def test_the_script_covers_the_mistakes_of_the_first_hour():
    typed = " ".join(line for line, _ in SCRIPT)
    for mistake in ("store.uri=s3:/", "train.epoch=", "submit --target kfp", "-o /nonexistent", "--resume",
                    "bad.yaml", "epochs=-1", "kpf", "checkpoints list"):
        assert mistake in typed
