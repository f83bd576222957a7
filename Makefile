# The two commands: `make demo` and `make test`. Both build .venv first when it is missing or
# older than pyproject.toml (`make setup`), so they work from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Without a GPU, torch is installed first at this pin: it is the CPU build that pip finds on the
# CI machines' disk. Any unpinned torch (or pyproject's torch>=2.4 alone) pulls a multi-GB CUDA build.
CPU_TORCH ?= torch==2.13.0

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install '$(CPU_TORCH)'; fi
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

# Until the real demo exists: rank the parallel configurations for this machine.
demo: $(STAMP)
	$(BIN)/xdit-lab plan

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
