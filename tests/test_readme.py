"""The README's reference tables are generated from the code; this keeps them from drifting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relaunch.components.core.contract.config import config_reference_markdown, exit_code_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize(("marker", "generate"), [("config-reference", config_reference_markdown),
                                                  ("exit-codes", exit_code_markdown)])
def test_readme_table_matches_the_code(marker, generate):
    text = README.read_text()
    found = re.search(rf"<!-- {marker}:start -->\n(.*?)\n<!-- {marker}:end -->", text, re.S)
    assert found, f"README lacks the {marker} markers"
    assert found.group(1) == generate(), "regenerate with: python -m relaunch.components.core.contract.config"


def test_readme_gives_the_two_setup_commands():
    text = README.read_text()
    assert "make run" in text and "make test" in text


# -- the README's claims a test can check

import shlex  # noqa: E402

ROOT = README.parent
NUMBERS = {"four": 4, "five": 5, "six": 6, "seven": 7}


def _code_lines() -> list[str]:
    """Every line of the README's fenced code blocks, without its trailing ``# comment``; an indented line
    (a diagram's) keeps its indentation, so it is not taken for a command."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", README.read_text(), re.S)
    lines = []
    for block in blocks:
        for line in block.splitlines():
            line = re.split(r"\s+#\s", line, maxsplit=1)[0].rstrip()  # indented: a diagram, not a command
            if line:
                lines.append(line)
    return lines


def _relaunch_commands() -> list[list[str]]:
    """``relaunch ...`` and ``make run ARGS="..."`` lines as argv; ``a|b`` alternatives become one argv each."""
    out = []
    for line in _code_lines():
        if line.startswith("relaunch "):
            argv = shlex.split(line)[1:]
        elif line.startswith("make run"):
            args = re.search(r'ARGS="([^"]*)"', line)
            argv = ["run", *shlex.split(args.group(1) if args else "")]
        else:
            continue
        variants = [argv]
        for i, word in enumerate(argv):
            if "|" in word and " " not in word and not word.startswith("-"):
                variants = [[*v[:i], alt, *v[i + 1:]] for v in variants for alt in word.split("|")]
        out += variants
    for args in re.findall(r'`make run ARGS="([^"]*)"`', README.read_text()):  # the table of failures to try
        out.append(["run", *shlex.split(args)])
    return out


def test_readme_has_relaunch_command_lines_to_check():
    commands = _relaunch_commands()
    assert len(commands) >= 10 and {c[0] for c in commands} >= {"run", "compile", "submit", "schedule", "render"}


@pytest.mark.parametrize("argv", _relaunch_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_relaunch_command_in_the_readme_parses_and_its_configuration_is_valid(argv):
    from relaunch.components.core.contract.config import load_config, with_pipeline_parameters
    from relaunch.pipelines.cli import build_parser

    argv = [a.replace("mypkg.mytask:make_task", "relaunch.components.tasks.digits:make_task") for a in argv]
    args = build_parser(argv[0]).parse_args(argv)  # an unknown flag or choice exits here
    if hasattr(args, "overrides"):
        config = load_config(ROOT / args.config if args.config else None, args.overrides)
        if getattr(args, "inject_failure", None):
            with_pipeline_parameters(config, {"inject_failure": args.inject_failure})


def test_the_readmes_cluster_lines_carry_a_configuration_for_the_cluster():
    cluster = [c for c in _relaunch_commands() if c[0] in ("compile", "submit", "schedule", "render")]
    assert cluster and all("--config" in c for c in cluster), [" ".join(c) for c in cluster if "--config" not in c]
    from relaunch.components.core.contract.config import load_config
    from relaunch.pipelines.commands.compile import local_services

    assert local_services(load_config(ROOT / "configs" / "cluster.yaml")) == []
    assert len(local_services(load_config())) == 2  # the defaults are this machine's: the lines need --config


def test_every_make_target_the_readme_names_exists():
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`make ([a-z-]+)", README.read_text())) | {
        line.split()[1] for line in _code_lines() if line.startswith("make ")}
    assert named and named <= targets, named - targets


def test_every_repository_path_the_readme_names_exists():
    text = README.read_text()
    paths = set(re.findall(r"\]\(((?:components|pipelines|configs|docs|tests|manifests|images)/[^)#\s]+)\)", text))
    paths |= set(re.findall(r"`((?:components|pipelines|configs|docs|tests|manifests|images)/[\w./-]+)`", text))
    paths = {p for p in paths if "<" not in p and "{" not in p}
    assert len(paths) >= 10
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == []


def test_the_step_count_and_the_step_table_match_the_pipeline_spec():
    from relaunch.pipelines.spec import PIPELINE

    text = README.read_text()
    said = re.search(r"One DAG of (\w+) steps and an exit handler \((\w+)", text)
    assert said, "the README says how many steps the DAG has"
    assert NUMBERS[said.group(1)] == len(PIPELINE.steps)
    rows = re.findall(r"^\| ([a-z-]+)(?: \(exit task\))? \| `components/", text, re.M)
    exit_steps = [s.name for s in PIPELINE.exit_handler if s.module.count(".") == 2]  # a step module of its own
    assert rows == [s.name for s in PIPELINE.steps] + exit_steps and said.group(2) == exit_steps[0]


def test_the_layout_names_the_launch_backends_there_are():
    from relaunch.components.launchers import LAUNCH_BACKENDS

    line = next(line for line in _code_lines() if line.startswith("components/launchers/"))
    named = re.search(r"rendered by (.*)$", line).group(1).replace(",", " ").split()
    assert sorted(named) == sorted(LAUNCH_BACKENDS)
    assert all((ROOT / "components" / "launchers" / f"{n}.py").exists() for n in named)


def test_make_ui_starts_one_worker_and_no_job_runner():
    ui = re.search(r"^ui:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "--workers 1" in ui and "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in ui


def test_relaunch_version_prints_the_installed_package_version():
    import subprocess
    import sys
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "relaunch.pipelines.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"relaunch {version('relaunch')}"
    assert "relaunch --version" in README.read_text()
