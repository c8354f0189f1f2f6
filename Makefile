# The two commands: `make demo` and `make test`. Each builds its own .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# Byte-code is written once at install, every file in parallel (compileall -j 0: half a minute
# on 2 cores; pip's own compile, one package after another, took a minute): a process started
# where the environment sets PYTHONDONTWRITEBYTECODE (common in container images) would
# otherwise parse torch and diffusers anew at every start (`import torch` 3.7-4.0 CPU-s against
# 1.5). One file of torch's tests is written for a newer Python and does not compile; the
# rest do, so compileall's exit status is not the install's.
unexport PYTHONDONTWRITEBYTECODE
PIP := $(BIN)/python -m pip install --quiet --no-compile -c constraints.txt
BYTECODE = { $(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	engine families examples > /dev/null 2>&1 || true; }
# stable-diffusion.cpp's binding (the `cpu` extra) builds ggml from its sdist (15-60 min on 2 cores);
# a wheel already built from that sdist is taken from ../shared/wheels where that folder exists.
WHEELS := $(wildcard ../shared/wheels)
FIND_LINKS := $(if $(WHEELS),--find-links $(WHEELS))

.PHONY: demo test check install browser clean bench gpu-check lock

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The worked third-party family is installed too, as a plugin author's package
# would be: the suite runs its contract kit (tests/contract/test_contract_kit.py).
$(STAMP): $(BIN)/python pyproject.toml constraints.txt examples/diffusion-engine-sd3/pyproject.toml
	$(PIP) $(FIND_LINKS) -e '.[test,cpu,ray]'
	$(PIP) -e ./examples/diffusion-engine-sd3
	$(BYTECODE)
	touch $(STAMP)

install: $(STAMP)

# The demo needs the engine and its charts, not the test tools (browser drivers, fuzzers):
# a plain (non-editable) install, which builds quietly. Where `make test` already made the
# editable development install (a superset), that one is kept.
$(DEMO_STAMP): $(BIN)/python pyproject.toml constraints.txt
	@if [ -f $(STAMP) ]; then echo "the development install (make test) is in place"; else \
		$(PIP) '.[charts]' && $(BYTECODE); fi
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python examples/demo.py

# The web page's browser tests drive Debian's chromium (never a downloaded browser):
# installed here when missing, where this user may (root with apt-get).
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; } || \
		echo "Debian's chromium is missing and cannot be installed here: sudo apt-get install chromium"

# One compute thread per process (xdist workers and the trainer children they start), or
# OpenMP threads oversubscribe the cores and spin-wait (measured on 2 cores: 7 min 25 s with
# torch's default threads, 6 min 8 s with one). One worker more than the two cores: a fifth of
# the suite's time is waiting (servers starting, ranks joining, a stop's grace, a child's
# import), and a third worker fills it (measured on 2 cores: 838 s with two workers, 739 s with
# three, less CPU time too). WORKERS=N sets another count.
WORKERS ?= 3
test: $(STAMP) browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist loadfile $(PYTEST_ARGS)

# PYTEST_ARGS: more pytest flags for either (`make test PYTEST_ARGS=--durations=30` lists the slowest).
# The fast loop: every test not marked slow (a test over a few seconds on two cores is marked
# `slow`), file by file over the workers as `make test` runs them. `make test` stays the whole suite (CI).
check: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/info_latency.py

# Every GPU path, measured, on the GPU this machine has (report: gpu-check.json).
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py $(GPU_CHECK_ARGS)
	$(BIN)/python bench/parallel_scaling.py --runs 2   # one request split over 1, 2, 4... of its GPUs

# The lock: every package `make install` resolved, pinned at the end of constraints.txt, so a
# fresh clone (and CI) installs the versions the suite last passed with, not each new release.
# Each pin holds where it was taken (this Python, Linux): elsewhere the ranges in pyproject.toml
# resolve as before. The hand-written pins above the marker are kept and not locked again (torch's
# stays the CPU build's). Run it after upgrading a dependency on purpose and passing `make test`.
LOCK_MARK := --- locked by make lock
lock: $(STAMP)
	where="; python_version == \"$$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')\" and sys_platform == \"linux\""; \
	hand=$$(sed -n '/^# $(LOCK_MARK)/q; /^[A-Za-z]/{s/[=<>!~ ;].*//; s/[-_.]/[-_.]/g; p}' constraints.txt | paste -sd '|'); \
	{ sed '/^# $(LOCK_MARK)/,$$d' constraints.txt; echo "# $(LOCK_MARK) on $$(date +%Y-%m-%d): the test environment"; \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -v -i -E "^($$hand)==" | sed "s|\$$| $$where|"; \
	} > constraints.txt.new && mv constraints.txt.new constraints.txt
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
