"""``~`` at the start of a path is the home directory, as a shell would have it, wherever relaunch reads a
path (store.uri, the tracking URI's file, the artifact location, --config, --state-dir): never a folder
named ``~`` in the working directory (which a clean-up would then remove with ``rm -rf ~``)."""

from __future__ import annotations

import pytest

from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.errors import BadInput
from tests.cli import relaunch_run


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def test_a_leading_tilde_in_the_configurations_paths_is_the_home_directory(home):
    config = load_config(None, ["store.uri=~/store", "tracking.uri=sqlite:///~/mlflow.db",
                                "tracking.artifact_location=~/artifacts", "tracking.tensorboard_dir=~/tb"])
    assert config.store.uri == f"{home}/store"
    assert config.tracking.uri == f"sqlite:///{home}/mlflow.db"
    assert config.tracking.artifact_location == f"{home}/artifacts"
    assert config.tracking.tensorboard_dir == f"{home}/tb"
    assert load_config(None, ["store.uri=s3://bucket/~x"]).store.uri == "s3://bucket/~x"  # only a leading one


def test_a_config_file_named_with_a_tilde_is_read_from_the_home_directory(home):
    (home / "mine.yaml").write_text("train:\n  epochs: 7\n")
    assert load_config("~/mine.yaml").train.epochs == 7


def test_a_tilde_that_names_no_home_is_refused_in_one_line():
    with pytest.raises(BadInput) as refused:
        load_config(None, ["store.uri=~no-such-user-here/store"])
    assert "\n" not in str(refused.value) and "store.uri" in str(refused.value) and "absolute path" in str(refused.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_relaunch_run_with_a_store_and_state_dir_under_tilde_writes_under_home_and_no_tilde_folder(tmp_path, home):
    cwd = tmp_path / "work"
    cwd.mkdir()
    out = relaunch_run(cwd, "--set", "train.max_steps=10", "--set", "store.uri=~/x",
                       "--set", "tracking.uri=sqlite:///~/mlflow.db", "--set", "tracking.artifact_location=~/art",
                       "--state-dir", "~/state", env={"HOME": str(home)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert list((home / "x" / "trainings").iterdir()) and (home / "mlflow.db").is_file() and (home / "state").is_dir()
    assert not [p for p in cwd.rglob("~*")], sorted(str(p) for p in cwd.rglob("~*"))
