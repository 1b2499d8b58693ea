# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.crowdtrain-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test bench clean

$(PYTHON):
	$(PY) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip

# Install the pinned torch first when none is there: a bare `torch` requirement would pull
# several GB of CUDA packages. An already installed torch (e.g. a CUDA build) is kept.
$(STAMP): pyproject.toml | $(PYTHON)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install --quiet $(TORCH_PIN)
	$(PYTHON) -m pip install --quiet -e ".[all,dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/crowdtrain demo

test: install
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) benchmarks/run_all.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
