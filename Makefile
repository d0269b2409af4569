# relaunch — every target creates .venv and installs what it needs on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LINKS := $(VENV)/relaunch-src
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)
IMAGE ?= ghcr.io/relaunch/relaunch
TAG ?= 0.1.0
ARGS ?=

.PHONY: help venv compile-bytecode links run tune test bench ui ui-check compile golden images clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-compile -c constraints.txt -e '.[test]'
	@$(MAKE) --no-print-directory compile-bytecode links
	@rm -f $(VENV)/.installed-*; touch $@

venv: $(STAMP) ## create .venv and install relaunch with its pinned dependencies

# pip compiles what it installs one file at a time; compileall on every core takes a third of the time. As
# pip does, a file that does not compile (torch ships Python 3.12 syntax for its own tests) is left as source.
compile-bytecode: ## (part of venv) compile the installed packages' .pyc files, all cores at once
	@$(BIN)/python -c "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_path('purelib'), quiet=2, workers=0)"

# The import names relaunch.components and relaunch.pipelines as folders that static tools (pyright,
# Pylance, jedi, a structure tool) can follow: $(LINKS)/relaunch/ holds two links to the source folders
# and a .pth puts $(LINKS) on the interpreter's path. pip's editable install maps the names with an import
# hook, which only a running interpreter sees; a file added to components/ or pipelines/ is seen at once.
links: ## (part of venv) link .venv/relaunch-src/relaunch/{components,pipelines} to the folders, on sys.path
	@mkdir -p $(LINKS)/relaunch
	@ln -sfn ../../../components $(LINKS)/relaunch/components
	@ln -sfn ../../../pipelines $(LINKS)/relaunch/pipelines
	@echo "$(abspath $(LINKS))" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/relaunch-src.pth"

run: $(STAMP) ## run the whole pipeline locally: 2 simulated nodes on CPU, local store, local MLflow
	$(BIN)/relaunch run $(ARGS)

tune: $(STAMP) ## a small study of the default task on this machine: 4 trials, 2 at once, Optuna (about 25 seconds)
	$(BIN)/relaunch tune --config configs/tune.yaml $(ARGS)

TEST_WORKERS ?= 3

test: $(STAMP) ## run the whole test suite (starts its own S3, PostgreSQL and MLflow servers), TEST_WORKERS files at once
	@$(BIN)/python -c "import ray" 2>/dev/null || $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[ray]'
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(ARGS)

bench: $(STAMP) ## run the benchmarks; prints tables and writes bench-results/*.json
	@$(BIN)/python -c "import ray" 2>/dev/null || $(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[ray]'
	$(BIN)/python -m tests.bench $(ARGS)

ui: $(STAMP) ## open the local MLflow UI on http://127.0.0.1:5000 (one worker, no job runner)
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --backend-store-uri sqlite:///./.relaunch/mlflow.db --default-artifact-root ./.relaunch/mlartifacts --host 127.0.0.1 --port 5000 --workers 1

ui-check: $(STAMP) ## a finished run's pages in headless Chromium (apt-get install chromium); screenshots to docs/
	RELAUNCH_UI_SCREENSHOTS=docs $(BIN)/python -m pytest -q tests/pipelines/test_lineage_e2e.py $(ARGS)

compile: $(STAMP) ## compile the KFP and Argo definitions to build/
	@mkdir -p build
	$(BIN)/relaunch compile --target kfp -o build/pipeline.kfp.yaml
	$(BIN)/relaunch compile --target argo -o build/workflow.argo.yaml
	$(BIN)/relaunch compile --target argo-template -o build/workflowtemplate.argo.yaml
	$(BIN)/relaunch compile --target argo-cron -o build/cronworkflow.argo.yaml

golden: $(STAMP) ## regenerate tests/golden/ and manifests/trainer/ from the default config (review the diff!)
	RELAUNCH_UPDATE_GOLDEN=1 $(BIN)/python -m pytest -q tests/pipelines tests/k8s -k golden

images: ## build and push the CPU and CUDA images (needs docker; IMAGE=... TAG=...)
	docker build -f images/Dockerfile -t $(IMAGE):$(TAG) .
	docker build -f images/Dockerfile.cuda -t $(IMAGE):$(TAG)-cuda .
	docker push $(IMAGE):$(TAG)
	docker push $(IMAGE):$(TAG)-cuda

clean: ## remove local state (.relaunch/) and build outputs, keep .venv
	rm -rf .relaunch build bench-results
