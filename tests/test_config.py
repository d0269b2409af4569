"""The configuration model: defaults, YAML + --set layering, and one-line errors naming the field."""

from __future__ import annotations

import pytest

from relaunch.components.core.contract.config import RelaunchConfig, parse_failure_spec
from relaunch.components.core.contract.config_loading import config_from_cli, load_config
from relaunch.components.core.contract.pipeline_parameters import (PIPELINE_PARAMETERS, pipeline_parameter_type,
                                                                   with_pipeline_parameters)
from relaunch.components.core.store import parse_store_uri
from relaunch.components.core.contract.errors import BadInput


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
        (["store.uri=hdfs://bucket/x"], "store.uri"),
        (["store.uri=s3:///nobucket"], "store.uri"),
        (["tracking.uri=ftp://host"], "tracking.uri"),
        (["tracking.uri=http://user:pw@host:5000"], "tracking.uri"),
        (["launch.inject_failure=explode@step=3"], "launch.inject_failure"),
        (["launch.inject_failure=preempt@step=x"], "launch.inject_failure"),
        (["store.uri=s3://Bad_Bucket/x"], "store.uri"),
        (["store.uri=s3://ab/x"], "store.uri"),
        (["store.uri=s3://bucket:9000/x"], "store.uri"),
        (["store.uri=s3://bucket/a/../b"], "store.uri"),
        (["store.uri=file://host/x"], "store.uri"),
        (["store.uri="], "store.uri"),
        (["train.warm_start_model=relaunch-digits"], "train.warm_start_model"),
        (["train.warm_start_model=models:/m/v1"], "train.warm_start_model"),
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


@pytest.mark.parametrize("uri", ["s3://Bad_Bucket/x", "s3://bucket:9000/x", "s3://bucket/a/../b", "hdfs://b/x",
                                 "file://host/x", "", "s3:/bucket/x", "foo:bar"])
def test_every_entry_point_refuses_a_bad_store_uri_with_the_same_rule(uri):
    """The configuration and open_store (the checkpoints CLI, a --store argument) apply one rule set."""
    from relaunch.components.core.store import open_store

    with pytest.raises(ValueError) as in_config:
        parse_store_uri(uri)
    with pytest.raises(BadInput) as in_store:
        open_store(uri)
    assert str(in_store.value) == str(in_config.value)
    with pytest.raises(BadInput, match="store.uri"):
        load_config(None, [f"store.uri={uri}"])


@pytest.mark.parametrize("uri, parsed", [
    ("./.relaunch/store", ("file", "./.relaunch/store", "")),
    ("file:///data/exp", ("file", "/data/exp", "")),
    ("s3://bucket-a/exp/run", ("s3", "bucket-a", "exp/run")),
])
def test_store_uris_parse_into_backend_and_location(uri, parsed):
    assert parse_store_uri(uri) == parsed
    assert load_config(None, [f"store.uri={uri}"]).store.uri == uri


@pytest.mark.parametrize("spec, parsed", [(None, (None, -1)), ("kill-worker@step=30", ("kill-worker", 30)),
                                          ("storage-outage@step=0", ("storage-outage", 0))])
def test_failure_specs_parse_into_kind_and_step(spec, parsed):
    assert parse_failure_spec(spec) == parsed


def test_a_bad_model_uri_is_refused_when_the_config_is_built_from_json():
    data = RelaunchConfig().model_dump()
    data["train"]["warm_start_model"] = "relaunch-digits@champion"
    with pytest.raises(BadInput, match="train.warm_start_model"):
        RelaunchConfig.from_json(__import__("json").dumps(data))
    data["train"]["warm_start_model"] = "models:/relaunch-digits@champion"
    assert RelaunchConfig.from_json(__import__("json").dumps(data)).train.warm_start_model.endswith("@champion")


def test_pipeline_parameters_are_typed_from_the_fields_they_override():
    assert {n: pipeline_parameter_type(n) for n in PIPELINE_PARAMETERS} == {
        "epochs": int, "max_steps": int, "learning_rate": float, "nodes": int, "procs_per_node": int,
        "inject_failure": str, "resume_from": str, "warm_start_model": str, "run_name": str}


@pytest.mark.parametrize("overrides, field, expected", [
    ({"epochs": 0}, "train.epochs", 4),
    ({"epochs": 7}, "train.epochs", 7),
    ({"epochs": "7"}, "train.epochs", 7),  # Argo passes every parameter as text
    ({"epochs": "0"}, "train.epochs", 4),
    ({"nodes": 3, "procs_per_node": 2}, "launch.nodes", 3),
    ({"learning_rate": 0.0}, "train.lr", 0.05),
    ({"learning_rate": 0.2}, "train.lr", 0.2),
    ({"inject_failure": ""}, "launch.inject_failure", None),
    ({"inject_failure": "preempt@step=4"}, "launch.inject_failure", "preempt@step=4"),
    ({"run_name": "nightly"}, "tracking.run_name", "nightly"),
    ({"warm_start_model": "models:/m@champion"}, "train.warm_start_model", "models:/m@champion"),
])
def test_pipeline_parameters_override_the_config_unless_they_hold_the_keep_value(overrides, field, expected):
    config = RelaunchConfig()
    folded = with_pipeline_parameters(config, overrides)
    section, key = field.split(".")
    assert getattr(getattr(folded, section), key) == expected
    assert config == RelaunchConfig(), "the configuration passed in is left as it was"


@pytest.mark.parametrize("overrides, message", [
    ({"epochs": -3}, "train.epochs"),
    ({"nodes": "many"}, "launch.nodes"),
    ({"inject_failure": "explode"}, "not a failure spec"),
    ({"warm_start_model": "relaunch-digits"}, "train.warm_start_model"),
    ({"colour": "blue"}, r"unknown pipeline parameter\(s\) colour"),
])
def test_bad_pipeline_parameters_are_bad_input_in_one_line(overrides, message):
    with pytest.raises(BadInput, match=message) as err:
        with_pipeline_parameters(RelaunchConfig(), overrides)
    assert "\n" not in str(err.value)


def test_folding_pipeline_parameters_never_parses_text_as_yaml():
    # "yes" and "1e3" are a bool and a float to YAML; a run name is text whatever it looks like
    assert with_pipeline_parameters(RelaunchConfig(), {"run_name": "yes"}).tracking.run_name == "yes"
    assert with_pipeline_parameters(RelaunchConfig(), {"run_name": "1e3"}).tracking.run_name == "1e3"


@pytest.mark.parametrize("uri, says", [
    ("s3:/bucket/x", "write the URI as s3://bucket/x"),
    ("s3:bucket/x", "write the URI as s3://bucket/x"),
    ("s3:", "write the URI as s3://bucket/prefix"),
    ("S3://bucket/x", "write the scheme in lowercase: s3://bucket/x"),
    ("S3:/bucket/x", "write the URI as s3://bucket/x"),
    ("file:relative/dir", "write the relative path without file: (relative/dir)"),
    ("file:/abs/dir", "write the URI as file:///abs/dir"),
    ("File:///abs/dir", "write the scheme in lowercase: file:///abs/dir"),
    ("hdfs:bucket", "hdfs is not supported"),
    ("my-store:v2", "for a local directory of that name write ./my-store:v2"),
    ("ftp://host/x", "scheme 'ftp' is not supported"),
])
def test_a_scheme_like_prefix_that_is_not_a_well_formed_store_uri_is_refused_naming_the_fix(uri, says):
    with pytest.raises(ValueError) as refused:
        parse_store_uri(uri)
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("uri, parsed", [
    ("./my-store:v2", ("file", "./my-store:v2", "")),  # the way to name such a directory
    ("C:/data/store", ("file", "C:/data/store", "")),  # one letter: a drive, not a scheme
    ("relative/dir", ("file", "relative/dir", "")),
])
def test_paths_that_merely_contain_a_colon_stay_paths(uri, parsed):
    assert parse_store_uri(uri) == parsed


def test_the_scheme_check_follows_the_registered_backends():
    """A backend registered later (gs, az) is accepted as <scheme>://... and its short forms get the fix."""
    from relaunch.components.core.store import BACKENDS, register_backend

    class Toy:
        scheme, example = "toy", "toy://bucket/prefix"

        @classmethod
        def parse(cls, uri):
            return uri.removeprefix("toy://").partition("/")[::2]

    register_backend(Toy)
    try:
        assert parse_store_uri("toy://b/p") == ("toy", "b", "p")
        with pytest.raises(ValueError, match="write the URI as toy://b/p"):
            parse_store_uri("toy:/b/p")
    finally:
        del BACKENDS["toy"]
    with pytest.raises(ValueError, match="scheme 'toy' is not supported"):
        parse_store_uri("toy://b/p")


@pytest.mark.parametrize("field, value, says", [
    ("tracking.uri", "sqlite:x.db", "write the URI as sqlite:///x.db"),
    ("tracking.uri", "sqlite://x.db", "three slashes"),
    ("tracking.uri", "http:/mlflow:5000", "write the URI as http://mlflow:5000"),
    ("tracking.uri", "HTTP://mlflow:5000", "lowercase: http://mlflow:5000"),
    ("tracking.uri", "http://", "names no host"),
    ("tracking.uri", "./mlruns", "a path is not one"),
    ("tracking.artifact_location", "s3:/bucket/x", "write the URI as s3://bucket/x"),
    ("tracking.artifact_location", "S3://bucket/x", "lowercase"),
    ("launch.kubernetes.store_endpoint", "minio:9000", "is not http(s)://host[:port]"),
])
def test_uri_typed_fields_refuse_what_does_not_parse_as_what_it_claims(field, value, says):
    with pytest.raises(BadInput) as refused:
        load_config(None, [f"{field}={value}"])
    assert field in str(refused.value) and says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("field, value", [
    ("tracking.uri", "sqlite:////abs/mlflow.db"), ("tracking.uri", "postgresql+psycopg2://u@db:5432/mlflow"),
    ("tracking.uri", "https://mlflow.example.com"), ("tracking.artifact_location", "mlflow-artifacts:/exp"),
    ("tracking.artifact_location", "s3://bucket/artifacts"), ("tracking.artifact_location", "./.relaunch/mlartifacts"),
    ("launch.kubernetes.store_endpoint", "https://minio.example.com:9000"),
])
def test_well_formed_uris_are_accepted(field, value):
    load_config(None, [f"{field}={value}"])


@pytest.mark.parametrize("key, guess", [("train.epoch", "train.epochs"), ("trian.epochs", "train"),
                                        ("launch.kubernetes.imag", "launch.kubernetes.image"), ("zzz", None)])
def test_an_unknown_key_gets_the_nearest_known_one(key, guess):
    with pytest.raises(BadInput) as refused:
        load_config(None, [f"{key}=1"])
    assert (f"did you mean {guess!r}?" in str(refused.value)) if guess else ("did you mean" not in str(refused.value))


def test_a_password_in_a_refused_uri_is_not_echoed():
    with pytest.raises(BadInput) as refused:
        load_config(None, ["tracking.uri=http://alice:s3cret@mlflow:5000"])
    assert "s3cret" not in str(refused.value)
