"""Cluster documents warn (stderr, one line per setting, after the document is written) when they would
carry this machine's store path or sqlite tracking to the pods; a configuration for the cluster
(configs/cluster.yaml) gets no warning, and neither does a document that does not run in pods (slurm)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relaunch.pipelines.cli import main

CLUSTER = str(Path(__file__).resolve().parents[2] / "configs" / "cluster.yaml")


@pytest.mark.parametrize("argv", [
    ["compile", "--target", "argo"],
    ["compile", "--target", "argo-cron"],
    ["compile", "--target", "kfp"],
    ["submit", "--target", "argo", "--dry-run"],
    ["schedule", "--target", "argo", "--cron", "0 3 * * *", "--dry-run"],
    ["render", "trainjob"],
    ["render", "pytorchjob"],
])
def test_a_cluster_document_of_the_default_configuration_warns_about_the_local_store_and_tracking(argv, tmp_path,
                                                                                                  capsys):
    if argv[0] in ("compile", "render"):
        argv = [*argv, "-o", str(tmp_path / "doc.yaml")]
    assert main(argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 2, warnings
    assert "store.uri './.relaunch/store'" in warnings[0] and "s3://bucket/prefix" in warnings[0]
    assert "tracking.uri 'sqlite:///./.relaunch/mlflow.db'" in warnings[1] and "MLflow server" in warnings[1]
    assert all("configs/cluster.yaml" in w for w in warnings)


@pytest.mark.parametrize("argv", [
    ["compile", "--target", "argo", "--config", CLUSTER],
    ["render", "trainjob", "--config", CLUSTER],
    ["compile", "--target", "argo", "--set", "store.uri=s3://relaunch/exp",
     "--set", "tracking.uri=http://mlflow.relaunch.svc:5000"],
    ["render", "slurm"],  # a Slurm job runs on the shared filesystem the path names
])
def test_a_configuration_fit_for_the_cluster_gets_no_warning(argv, tmp_path, capsys):
    assert main([*argv, "-o", str(tmp_path / "doc.yaml")]) == 0
    assert "warning" not in capsys.readouterr().err


def test_only_the_store_warns_when_tracking_is_a_server(tmp_path, capsys):
    assert main(["render", "trainjob", "--set", "tracking.uri=http://mlflow:5000", "-o", str(tmp_path / "j.yaml")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "store.uri" in warnings[0]
