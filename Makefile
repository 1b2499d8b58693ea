# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.crowdtrain-installed
TORCH_PIN ?= torch==2.13.0

.PHONY: install sysdeps demo test bench clean

# System packages: python3-venv (the virtual environment), chromium (the browser tests drive
# Debian's chromium through Playwright), iproute2 (the testbed's namespaces and tc links),
# postgresql (the database tests start a throw-away cluster of it; the coordinator needs none),
# fonts-noto-color-emoji (the real pictures of `crowdtrain demo --data emoji` are drawn with it),
# caddy (the tests put a coordinator behind it, as the guide's HTTPS deployment does), mitmproxy
# (the tests' attacker on the path), openssh-client (ssh-keygen: the key fingerprint is ssh's).
# Installed with apt when missing and run as root; otherwise stop with the command to run.
SYSPKGS_MISSING = $(strip $(shell $(PY) -c "import ensurepip" 2>/dev/null || echo python3-venv) \
	$(shell command -v chromium >/dev/null || echo chromium) \
	$(shell command -v ip >/dev/null && command -v tc >/dev/null || echo iproute2) \
	$(shell ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null || echo postgresql) \
	$(shell test -f /usr/share/fonts/truetype/noto/NotoColorEmoji.ttf || echo fonts-noto-color-emoji) \
	$(shell command -v caddy >/dev/null || echo caddy) \
	$(shell command -v mitmdump >/dev/null || echo mitmproxy) \
	$(shell command -v ssh-keygen >/dev/null || echo openssh-client))

sysdeps:
ifneq ($(SYSPKGS_MISSING),)
	@if [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSPKGS_MISSING); \
	else \
		echo "missing system packages: $(SYSPKGS_MISSING); run: sudo apt-get install -y $(SYSPKGS_MISSING)"; exit 1; \
	fi
endif

$(PYTHON): | sysdeps
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

# Two pytest-xdist workers (11:20 to 11:44 in four fresh runs on the 2-core machine the suite is
# timed on, longer on a slower or busier one; one test at a time, TEST_WORKERS=0, takes about
# 21). The tests marked `swarm` (real-process swarms whose checks
# depend on timing) run one after another on one worker, first; the other worker takes the rest
# of the suite at nice 5 (its tests' own sessions too, where the kernel schedules by session), so
# the lane's peers get the CPU first and the rest fills the time they wait on rounds
# (tests/conftest.py). Two such swarms at once starve each other's peers
# past their margins (2 of 3 runs without the lane failed a check), and so, less often, does the
# rest of the suite at equal priority (a run with the lane but without nice needed two reruns).
# More workers share the rest of the suite; the lane stays one.
TEST_WORKERS ?= 2
test: sysdeps install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS)

bench: install
	$(PYTHON) benchmarks/run_all.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
