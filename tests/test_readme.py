"""The README and the pages under docs/ it sends a newcomer to: their reference tables are generated from the
code, every behaviour they state sits beside the test that holds it (and that test exists), their command
lines parse, and the paths, targets and figures they name are the code's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from relaunch.components.core.contract.reference_tables import config_reference_markdown, exit_code_markdown

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# the pages that state behaviour beside its test; docs/architecture.md, cluster.md, checkpoint-format.md,
# warm-runtime.md and benchmarks.md describe design, platforms and measurements
PAGES = [README, *(DOCS / f"{name}.md" for name in ("running-locally", "fault-tolerance", "recovery-from-memory",
                                                    "tuning", "configuration", "tracking", "development"))]
NUMBERS = {"four": 4, "five": 5, "six": 6, "seven": 7}
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")
README_MAX_LINES = 250


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _text(page: Path = README) -> str:
    return page.read_text()


# -- generated tables

@pytest.mark.parametrize(("page", "marker", "generate"), [
    (DOCS / "configuration.md", "config-reference", config_reference_markdown),
    (README, "exit-codes", exit_code_markdown)], ids=["config-reference", "exit-codes"])
def test_a_reference_table_matches_the_code(page, marker, generate):
    found = re.search(rf"<!-- {marker}:start -->\n(.*?)\n<!-- {marker}:end -->", _text(page), re.S)
    assert found, f"{_page_id(page)} lacks the {marker} markers"
    assert found.group(1) == generate(), (f"the table in {_page_id(page)} is not the code's: regenerate it with "
                                          "python -m relaunch.components.core.contract.reference_tables")


# -- the README is a page a newcomer reads in ten minutes

def test_readme_gives_the_two_setup_commands():
    text = _text()
    assert "make run" in text and "make test" in text
    assert re.search(r"^## Two commands$", text, re.M)


def test_the_readme_is_short_and_sends_the_depth_to_docs():
    lines = _text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README has {len(lines)} lines; move the depth to docs/"
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", _text()))
    assert {_page_id(p) for p in PAGES[1:]} <= linked, {_page_id(p) for p in PAGES[1:]} - linked


def test_the_section_for_your_own_model_and_data_follows_the_demo():
    headings = re.findall(r"^## (.*)$", _text(), re.M)
    demo = next(i for i, h in enumerate(headings) if h.startswith("See the fault tolerance"))
    assert headings[demo + 1] == "Your own model and data", headings
    section = _text().split("## Your own model and data\n", 1)[1].split("\n## ", 1)[0]
    assert "<!-- issue 41:" in section or "configs/lm.yaml" in section


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_heading_of_a_page_is_a_heading_not_a_pasted_line(page):
    headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", _text(page), flags=re.S), re.M)
    bad = [h for h in headings if '"' in h or h.rstrip().endswith(":")]
    assert headings and not bad, bad
    assert len(headings) == len(set(headings)), "a heading appears twice"


def test_the_readme_states_make_tests_time_and_its_goal():
    assert "about 18 minutes on 2 cores (goal ~12)" in _text()


def test_the_readmes_summary_line_is_the_one_the_console_prints():
    from relaunch.pipelines.local.console import _ettr

    assert f"8.0s training in 9.8s launch; {_ettr(0.331)}" in _text()


# -- every behaviour beside the test that holds it

def _behaviour_rows(page: Path) -> list[list[str]]:
    """The body rows of each table whose last column is "the test", as their cells."""
    rows, in_table = [], False
    for line in _text(page).splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not in_table:
            in_table, keep = True, cells[-1] == "the test"
            header = True
            continue
        if header:  # the |---| line
            header = False
            continue
        if keep:
            rows.append(cells)
    return rows


def _local_run_tests() -> set[str]:
    return set(re.findall(r"^def (test_\w+)\(", (ROOT / "tests/pipelines/test_local_run.py").read_text(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_behaviour_a_page_states_names_the_test_that_checks_it(page):
    rows = _behaviour_rows(page)
    assert rows, f"{_page_id(page)} states its behaviour in a table whose last column is 'the test'"
    local_run = _local_run_tests()
    unheld = []
    for cells in rows:
        named = TEST_REF.findall(cells[-1])
        bare = re.fullmatch(r"`(test_\w+)`", cells[-1])  # the README's failures table: tests/pipelines/test_local_run.py
        if not named and not (bare and bare.group(1) in local_run):
            unheld.append(cells[0])
    assert unheld == [], f"rows of {_page_id(page)} that name no test"


def _defined_tests(path: Path) -> set[str]:
    return set(re.findall(r"^(?:async )?def (test_\w+)\(", path.read_text(), re.M))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_test_a_page_names_exists(page):
    refs = TEST_REF.findall(_text(page))
    missing = [f"{f}::{t}" for f, t in refs if not (ROOT / f).is_file() or t not in _defined_tests(ROOT / f)]
    assert refs and missing == []


# -- figures the pages state are the code's

def test_the_figures_the_pages_state_are_the_codes_constants():
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.tracking.client import TRIES
    from relaunch.components.core.tracking.runlogger import WAIT_WHILE_LOST_SECONDS

    faults = _text(DOCS / "fault-tolerance.md")
    assert f"at most {WAIT_WHILE_LOST_SECONDS:g} s (`WAIT_WHILE_LOST_SECONDS`)" in faults
    assert f"is tried {TRIES} times" in faults
    assert f"`train.store_unwritable_saves` ({RelaunchConfig().train.store_unwritable_saves})" in faults


def test_make_tune_is_the_study_the_pages_say():
    from relaunch.components.core.contract.config_loading import load_config

    tune = load_config(ROOT / "configs" / "tune.yaml").tune
    assert f"{tune.trials} trials, {tune.parallel} at once" in _text(DOCS / "tuning.md")


def test_the_readme_says_where_the_pipeline_is_written_and_it_is_there():
    from relaunch.pipelines import spec

    said = re.search(r"written once in (\S+\.py)", _text())
    assert said and (ROOT / said.group(1)).resolve() == Path(spec.__file__).resolve()


# -- command lines, paths and targets

def _code_lines(pages=PAGES) -> list[str]:
    """Every line of the pages' fenced code blocks, without its trailing ``# comment``; an indented line
    (a diagram's) keeps its indentation, so it is not taken for a command."""
    lines = []
    for page in pages:
        for block in re.findall(r"```[a-z]*\n(.*?)```", _text(page), re.S):
            for line in block.splitlines():
                line = re.split(r"\s+#\s", line, maxsplit=1)[0].rstrip()
                if line:
                    lines.append(line)
    return lines


def _relaunch_commands(pages=PAGES) -> list[list[str]]:
    """``relaunch ...`` and ``make run ARGS="..."`` lines as argv; ``a|b`` alternatives become one argv each."""
    out = []
    for line in _code_lines(pages):
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
    for page in pages:  # inline, as in the README's table of failures to try
        for args in re.findall(r'`make run ARGS="([^"]*)"`', _text(page)):
            out.append(["run", *shlex.split(args)])
    return out


def test_the_pages_have_relaunch_command_lines_to_check():
    commands = _relaunch_commands()
    assert len(commands) >= 10 and {c[0] for c in commands} >= {"run", "compile", "submit", "schedule", "render",
                                                               "tune", "trainings", "checkpoints"}


@pytest.mark.parametrize("argv", _relaunch_commands(), ids=lambda a: " ".join(a)[:60])
def test_every_relaunch_command_in_the_pages_parses_and_its_configuration_is_valid(argv):
    from relaunch.components.core.contract.config_loading import load_config
    from relaunch.components.core.contract.pipeline_parameters import with_pipeline_parameters
    from relaunch.pipelines.cli import build_parser

    argv = [a.replace("mypkg.mytask:make_task", "relaunch.components.tasks.digits:make_task") for a in argv]
    args = build_parser(argv[0]).parse_args(argv)  # an unknown flag or choice exits here
    if hasattr(args, "overrides"):
        config = load_config(ROOT / args.config if args.config else None, args.overrides)
        if getattr(args, "inject_failure", None):
            with_pipeline_parameters(config, {"inject_failure": args.inject_failure})


def test_the_readmes_cluster_lines_carry_a_configuration_for_the_cluster():
    cluster = [c for c in _relaunch_commands([README]) if c[0] in ("compile", "submit", "schedule", "render")]
    assert cluster and all("--config" in c for c in cluster), [" ".join(c) for c in cluster if "--config" not in c]
    from relaunch.components.core.contract.config_loading import load_config
    from relaunch.pipelines.commands.compile import local_services

    assert local_services(load_config(ROOT / "configs" / "cluster.yaml")) == []
    assert len(local_services(load_config())) == 2  # the defaults are this machine's: the lines need --config


def test_every_make_target_the_pages_name_exists():
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = {t for page in PAGES for t in re.findall(r"`make ([a-z-]+)", _text(page))} | {
        line.split()[1] for line in _code_lines() if line.startswith("make ")}
    assert named and named <= targets, named - targets


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_repository_path_a_page_names_exists(page):
    text = _text(page)
    tops = "components|pipelines|configs|docs|tests|manifests|images"
    paths = {ROOT / p for p in re.findall(rf"`((?:{tops})/[\w./-]+)`", text)}
    links = re.findall(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)", text)  # a markdown link is relative to its page
    paths |= {(page.parent / p) for p in links}
    paths = {p for p in paths if "<" not in str(p) and "{" not in str(p)}
    missing = sorted(str(p.relative_to(ROOT)) if p.resolve().is_relative_to(ROOT) else str(p)
                     for p in paths if not p.exists())
    assert paths and missing == []


def test_the_step_count_and_the_step_table_match_the_pipeline_spec():
    from relaunch.pipelines.spec import PIPELINE

    text = _text()
    said = re.search(r"One DAG of (\w+) steps and an exit handler \((\w+)", text)
    assert said, "the README says how many steps the DAG has"
    assert NUMBERS[said.group(1)] == len(PIPELINE.steps)
    rows = re.findall(r"^\| ([a-z-]+)(?: \(exit task\))? \| `components/", text, re.M)
    exit_steps = [s.name for s in PIPELINE.exit_handler if s.module.count(".") == 2]  # a step module of its own
    assert rows == [s.name for s in PIPELINE.steps] + exit_steps and said.group(2) == exit_steps[0]


def test_the_layout_names_the_launch_backends_there_are():
    from relaunch.components.launchers import LAUNCH_BACKENDS

    line = next(line for line in _code_lines([DOCS / "development.md"]) if line.startswith("components/launchers/"))
    named = re.search(r"rendered by (.*)$", line).group(1).replace(",", " ").split()
    assert sorted(named) == sorted(LAUNCH_BACKENDS)
    assert all((ROOT / "components" / "launchers" / f"{n}.py").exists() for n in named)


def test_make_ui_starts_one_worker_and_no_job_runner():
    ui = re.search(r"^ui:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "--workers 1" in ui and "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false" in ui
    assert "--workers 1" in _text(DOCS / "tracking.md")


def test_relaunch_version_prints_the_installed_package_version():
    import subprocess
    import sys
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "relaunch.pipelines.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"relaunch {version('relaunch')}"
    assert "relaunch --version" in _text()
