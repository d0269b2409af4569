"""The configuration model: defaults, YAML + --set layering, and one-line errors naming the field."""

from __future__ import annotations

import pytest

from components.core.config import RelaunchConfig, config_from_cli, load_config
from components.core.errors import BadInput


def test_defaults_are_the_embedded_local_setup():
    config = load_config()
    assert config.store.uri == "./.relaunch/store"
    assert config.tracking.uri == "sqlite:///./.relaunch/mlflow.db"
    assert config.launch.backend == "local" and config.launch.world_size == 2


def test_overrides_win_over_the_file_and_are_parsed_as_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.5\n  epochs: 2\nlaunch:\n  nodes: 3\n")
    config = load_config(path, ["train.lr=0.01", "launch.kubernetes.node_selector={pool: gpu}", "train.amp=true"])
    assert config.train.lr == 0.01 and config.train.epochs == 2 and config.launch.nodes == 3
    assert config.launch.kubernetes.node_selector == {"pool": "gpu"} and config.train.amp is True


def test_config_json_round_trips_through_the_step_cli_path():
    config = load_config(None, ["train.epochs=7", "store.uri=s3://bucket-a/exp"])
    again = config_from_cli(None, config.to_json(), ["launch.nodes=4"])
    assert again.train.epochs == 7 and again.store.uri == "s3://bucket-a/exp" and again.launch.nodes == 4


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["train.lrr=1"], "train.lrr"),
        (["train.lr=-1"], "train.lr"),
        (["train.epochs=many"], "train.epochs"),
        (["launch.nodes=0"], "launch.nodes"),
        (["launch.backend=slurm"], "launch.backend"),
        (["store.uri=gs://bucket/x"], "store.uri"),
        (["store.uri=s3:///nobucket"], "store.uri"),
        (["tracking.uri=ftp://host"], "tracking.uri"),
        (["tracking.uri=http://user:pw@host:5000"], "tracking.uri"),
        (["launch.inject_failure=explode@step=3"], "launch.inject_failure"),
        (["name=Not_Kebab"], "name"),
        (["launch.min_nodes=5"], "launch"),
        (["noequals"], "noequals"),
        (["train.lr.x=1"], "train.lr"),
    ],
)
def test_bad_values_name_the_field_in_one_line(overrides, names):
    with pytest.raises(BadInput) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert names in message and "\n" not in message


def test_missing_and_malformed_files_are_bad_input(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(BadInput, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42")
    with pytest.raises(BadInput, match="mapping"):
        load_config(scalar)
    with pytest.raises(BadInput, match="not valid JSON"):
        config_from_cli(None, "{not json", [])


def test_every_field_has_a_description_for_the_ui_and_readme():
    missing = []

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, RelaunchConfig.__mro__[1]):
                walk(annotation, f"{prefix}{name}.")
            elif not field.description:
                missing.append(prefix + name)

    walk(RelaunchConfig, "")
    assert missing == []
