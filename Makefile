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

.PHONY: setup demo test browser-test notebooks format clean

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

# The whole test suite: pytest, then every tutorial and notebook re-run by nbval, its outputs
# compared with the committed ones (after tutorials/nbval_sanitize.cfg's rewrites).
NOTEBOOKS := tutorials notebooks
test: $(STAMP) $(KERNEL)
	$(BIN)/ruff check xdit_lab tests benchmarks
	$(BIN)/ruff format --check xdit_lab tests benchmarks
	$(BIN)/python -m pytest -q tests
	$(BIN)/python -m pytest -q -p no:cacheprovider --nbval --nbval-sanitize-with tutorials/nbval_sanitize.cfg $(NOTEBOOKS)

# The explorer in a real browser: JupyterLab served on 127.0.0.1, notebooks/explorer.ipynb run
# with Run All Cells, its buttons clicked (tests/browser/). Playwright drives Debian's chromium,
# installed here when missing: Playwright's own browser download is not used.
CHROMIUM := /usr/bin/chromium
BROWSER_STAMP := $(VENV)/.installed-browser
browser-test: $(STAMP) $(KERNEL) $(BROWSER_STAMP) $(CHROMIUM)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/browser/browser_explorer.py

$(BROWSER_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[test,browser]'
	touch $(BROWSER_STAMP)

$(CHROMIUM):
	apt-get update && apt-get install -y chromium

# After changing a notebook: run it and save it with its outputs, as nbval will compare them
# (NB="tutorials/02_ulysses.ipynb ..."; default: every tutorial and notebook).
NB ?= $(wildcard tutorials/*.ipynb notebooks/*.ipynb)
notebooks: $(STAMP) $(KERNEL)
	$(BIN)/python -m xdit_lab.tools.notebooks $(NB)

# Lint fixes and formatting, as `make test` checks them (settings in pyproject.toml).
format: $(STAMP)
	$(BIN)/ruff check --fix xdit_lab tests benchmarks
	$(BIN)/ruff format xdit_lab tests benchmarks

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
