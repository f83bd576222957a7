# The two commands: `make demo` and `make test`. Both build .venv and install the notebooks' kernel first when
# they are missing or older than pyproject.toml (`make setup`), so they work from a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Without a GPU, torch is installed first at this pin: it is the CPU build that pip finds on the
# CI machines' disk. Any unpinned torch (or pyproject's torch>=2.4 alone) pulls a multi-GB CUDA build.
CPU_TORCH ?= torch==2.13.0
# On a GPU host, pin the CUDA build of torch instead of taking pip's newest (which may need a newer
# driver than yours): make setup TORCH='torch==2.5.1' TORCH_INDEX=https://download.pytorch.org/whl/cu121
TORCH ?=
TORCH_INDEX ?=

# The notebooks' kernel ("xdit-lab" in their metadata), installed into .venv so nbval finds it there.
KERNEL := $(VENV)/share/jupyter/kernels/xdit-lab/kernel.json

.PHONY: setup demo test pytest nbval browser-test notebooks format clean ssh-server
.PHONY: setup-gpu gpu-check gpu-wheels

setup: $(STAMP) $(KERNEL)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if [ -n "$(TORCH)" ]; then $(BIN)/pip install '$(TORCH)' $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); fi
	if [ -z "$(TORCH)" ] && ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install '$(CPU_TORCH)'; fi
	$(BIN)/pip install -e '.[test]'
	$(BIN)/python -m xdit_lab.env  # which torch this is, and whether CUDA is usable (a warning if not)
	touch $(STAMP)

$(KERNEL): $(STAMP)
	$(BIN)/python -m ipykernel install --sys-prefix --name xdit-lab --display-name "Python (xdit-lab)"

# The ten digits drawn by the bundled model, on local ranks with a strategy that fits this machine. The notebooks'
# kernel is installed too: the README's first command leaves the tutorials runnable.
demo: $(STAMP) $(KERNEL)
	$(BIN)/xdit-lab demo

# The whole test suite: pytest, and every tutorial and notebook re-run by nbval, its outputs
# compared with the committed ones (after tutorials/nbval_sanitize.cfg's rewrites).
NOTEBOOKS := tutorials notebooks
# The suite runs the CPU path (gloo ranks, CPU engines), also on a GPU host: GPUs hidden from it.
# tests/gpu is collected and skipped there; `make gpu-check` runs it.
# tests/ and the notebooks run as one queue on two workers (pytest-xdist): each file, test file or notebook, goes
# whole to the next free worker, longest first (conftest.py). Each worker leaves part of a core idle (spawns,
# engine start-ups, timeouts waited out), which the other fills, until the queue is empty: run as two halves side
# by side, the tests ran alone for their last 20 minutes with a third of the CPU idle. `make pytest` or `make nbval`
# runs one half alone.
PYTEST_NBVAL := --nbval --nbval-sanitize-with tutorials/nbval_sanitize.cfg
test: export CUDA_VISIBLE_DEVICES :=
test: $(STAMP) $(KERNEL) ssh-server
	$(BIN)/ruff check xdit_lab tests benchmarks
	$(BIN)/ruff format --check xdit_lab tests benchmarks
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=60 --calibrate $(PYTEST_NBVAL) tests $(NOTEBOOKS)

pytest: export CUDA_VISIBLE_DEVICES :=
pytest: $(STAMP) $(KERNEL) ssh-server
	$(BIN)/python -m pytest -q --durations=60 tests

# The tests over two hosts (tests/two_hosts.py) log in to each host with ssh: sshd is installed here when it is
# missing and this runs as root (CI); elsewhere those tests are skipped and say why.
ssh-server:
	@if [ ! -x /usr/sbin/sshd ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update && apt-get install -y openssh-server; fi

nbval: export CUDA_VISIBLE_DEVICES :=
nbval: $(STAMP) $(KERNEL)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20 $(PYTEST_NBVAL) $(NOTEBOOKS)

# The explorer in a real browser: JupyterLab served on 127.0.0.1, notebooks/explorer.ipynb run
# with Run All Cells, its buttons clicked (tests/browser/). Playwright drives Debian's chromium,
# installed here when missing: Playwright's own browser download is not used. `make browser-deps`
# installs the two alone; .ci/run runs it beside `make test`.
CHROMIUM := /usr/bin/chromium
BROWSER_STAMP := $(VENV)/.installed-browser
browser-test: $(STAMP) $(KERNEL) browser-deps
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/browser/browser_explorer.py

.PHONY: browser-deps
browser-deps: $(BROWSER_STAMP) $(CHROMIUM)

# The `browser` extra's packages only, as the installed project's metadata lists them (pyproject.toml's, as
# $(STAMP) installed it): the project and its [test] extra are there already, and reinstalling the project
# (pip install -e) would take it away for a moment from any process starting meanwhile, such as a test's,
# when this runs beside `make test`.
define BROWSER_REQUIREMENTS
from importlib.metadata import requires
from packaging.requirements import Requirement
for r in map(Requirement, requires("xdit-lab")):
    if r.marker is not None and r.marker.evaluate({"extra": "browser"}):
        print(r.name + (f"[{','.join(sorted(r.extras))}]" if r.extras else "") + str(r.specifier))
endef
$(BROWSER_STAMP): export BROWSER_REQUIREMENTS := $(BROWSER_REQUIREMENTS)
$(BROWSER_STAMP): $(STAMP)
	$(BIN)/python -c "$$BROWSER_REQUIREMENTS" > $(VENV)/browser-requirements.txt
	$(BIN)/pip install -r $(VENV)/browser-requirements.txt
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

# flash-attn on a CUDA host: it compiles against the installed torch, so not in pip's build isolation.
setup-gpu: $(STAMP)
	$(BIN)/pip install --no-build-isolation 'flash-attn>=2.6'
	$(BIN)/python -m xdit_lab.env --require-cuda

# The GPU tier (tests/gpu) on this machine's GPUs, then its table (also in outputs/gpu-check.md).
# Without .venv (a bare GPU machine) it uses python3 and installs what is missing from $(WHEELS)
# (see `make gpu-wheels`), never torch: the installed torch is pinned as a constraint.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
WHEELS ?= build/wheels
GPU_REPORT ?= outputs/gpu-check.md
gpu-check:
	if [ -d $(WHEELS) ]; then mkdir -p build && $(GPU_PYTHON) -c "import torch; print('torch==' + torch.__version__)" > build/torch-pin.txt && $(GPU_PYTHON) -m pip install -q --no-index --find-links $(WHEELS) -c build/torch-pin.txt $(GPU_TIER_PACKAGES); fi
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m xdit_lab.env
	PYTHONPATH=$(CURDIR) XDIT_LAB_GPU_REPORT=$(GPU_REPORT) $(GPU_PYTHON) -m pytest -p no:cacheprovider -v tests/gpu

# Wheels for a GPU machine without network (Python 3.12, Linux x86-64): what tests/gpu needs beyond
# torch, transformers, accelerate, safetensors and einops, at the versions in this .venv. Run it here
# (with network), carry $(WHEELS) there; it is ignored by git (build/).
GPU_TIER_PACKAGES := diffusers ipyparallel torchao
GPU_WHEEL_NAMES := diffusers torchao importlib_metadata lazy-importer ipyparallel ipykernel ipython ipython_pygments_lexers jupyter_client \
	jupyter_core traitlets decorator pyzmq tornado comm debugpy matplotlib-inline nest-asyncio2 jedi parso pexpect \
	ptyprocess prompt_toolkit wcwidth stack_data executing asttokens pure_eval platformdirs
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform any -d $(WHEELS) \
		$$($(BIN)/python -c "import sys; from importlib.metadata import version; print(' '.join(f'{n}=={version(n)}' for n in sys.argv[1:]))" $(GPU_WHEEL_NAMES))

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
