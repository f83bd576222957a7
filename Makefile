# The two commands: `make demo` and `make test`. Both build .venv first when it is missing or
# older than pyproject.toml (`make setup`), so they work from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Without a GPU, torch is installed first at this pin: it is the CPU build that pip finds on the
# CI machines' disk. Any unpinned torch (or pyproject's torch>=2.4 alone) pulls a multi-GB CUDA build.
CPU_TORCH ?= torch==2.13.0

# The notebooks' kernel ("xdit-lab" in their metadata), installed into .venv so nbval finds it there.
KERNEL := $(VENV)/share/jupyter/kernels/xdit-lab/kernel.json

.PHONY: setup demo test clean

setup: $(STAMP) $(KERNEL)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install '$(CPU_TORCH)'; fi
	$(BIN)/pip install -e '.[test]'
	touch $(STAMP)

$(KERNEL): $(STAMP)
	$(BIN)/python -m ipykernel install --sys-prefix --name xdit-lab --display-name "Python (xdit-lab)"

# The ten digits drawn by the bundled model, on local ranks with a strategy that fits this machine.
demo: $(STAMP)
	$(BIN)/xdit-lab demo

# The whole test suite. (The notebooks join under nbval once they are committed with their outputs.)
test: $(STAMP) $(KERNEL)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
