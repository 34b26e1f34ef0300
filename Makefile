# The two commands a new user runs, as root, on a fresh Debian 12 machine:
#   make demo   install everything, then freeze and restore a real training job, then move a training
#               PyTorchJob worker between the kubelet nodes of a local Kubernetes (scripts/local-cluster demo)
#   make test   install everything, then run the whole test suite
VENV := .venv

.PHONY: install demo test bench bench-migrate lint clean image
install:
	@bash scripts/bootstrap.sh

demo: install
	$(VENV)/bin/criuctl demo
	@bash scripts/install-kubernetes.sh
	scripts/local-cluster demo

# CRIUCTL_TESTS_REQUIRE_ALL=1: what make test installs or checks must be there, or the run stops at once
# with one line per missing thing; never a skip (tests/requirements.py). Only a GPU is a skip.
test: install
	@bash scripts/test-fixtures.sh
	CRIUCTL_TESTS_REQUIRE_ALL=1 bash scripts/run-tests.sh $(VENV)/bin/python

# the agent image (Dockerfile) with buildah, podman or docker: criuctl-agent:VERSION-gCOMMIT
# (docs/deploy.md, "The image"); `scripts/build-image.sh --push REPO` also pushes it
image:
	@bash scripts/build-image.sh

bench: install
	$(VENV)/bin/python bench/dump_restore.py
	$(VENV)/bin/python bench/restore_limits.py
	$(VENV)/bin/python bench/migrate.py

bench-migrate: install
	$(VENV)/bin/python bench/migrate.py

# ruff, the formatter, the layer contract (pyproject.toml [tool.importlinter]): a module that
# imports a layer above its own fails here, as does the hook importing criuctl; and the type check
# ([tool.mypy]: strict on core, engine, format, agent, client, whose JSON is typed in agent/messages)
lint: install
	$(VENV)/bin/ruff check criuctl hooks tools tests bench setup.py
	$(VENV)/bin/ruff format --check criuctl hooks tools tests bench setup.py
	PYTHONPATH=hooks $(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# build/: also the CRI stubs the editable install imports (setup.py)
clean:
	rm -rf $(VENV) .pytest_cache build
