# One command each: `make demo` and `make test` install what is missing, then run (an editable install from this
# checkout whose pyproject.toml is unchanged is not redone: tools/installed_here.py).
PYTHON ?= python3
SHARED ?= $(abspath ../shared)
TORCH_VERSION ?= 2.13.0
export HF_UNLEARN_DATA_DIR ?= $(SHARED)/data
export TOKENIZERS_PARALLELISM = false

.PHONY: torch install install-dev demo test test-slow test-latest constraints docs docs-serve architecture bench lint clean

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel.
torch:
	@$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$(TORCH_VERSION)' else 1)" 2>/dev/null \
		|| $(PYTHON) -m pip install -q "torch==$(TORCH_VERSION)"

# Each installs once: skipped when already editable from here with every requirement of its extras (~30 s saved)
install: torch
	@$(PYTHON) tools/installed_here.py . all || $(PYTHON) -m pip install -q -e ".[all]"

install-dev: torch
	@$(PYTHON) tools/installed_here.py . dev || $(PYTHON) -m pip install -q -c constraints.txt -e ".[dev]"

demo: install   # offline, no data folder needed (the TOFU rows ship in the package); runnable again in place
	$(PYTHON) -m hf_unlearn demo

# two workers (pytest-xdist), one per core of CI's machine; TEST_WORKERS=0 runs in this process
TEST_WORKERS ?= 2
test: install-dev
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist load

test-slow: install-dev
	$(PYTHON) -m pytest -m slow

# CI as it runs (.ci/run: a new venv), but with the newest releases instead of constraints.txt
test-latest:
	CI_LATEST=1 bash .ci/run

# rewrite constraints.txt from the newest releases (a new venv); commit it only after `bash .ci/run` passes
constraints:
	bash tools/write_constraints.sh

# the documentation site, offline, from this checkout's files only; strict: a broken link, a page missing from the nav or
# a docstring reference that does not resolve fails (tests/test_docs.py builds it the same way in `make test`)
docs:
	@$(PYTHON) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(PYTHON) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=. $(PYTHON) -m mkdocs build --strict --site-dir build/docs
	@echo "open build/docs/index.html"

docs-serve: docs
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=. $(PYTHON) -m mkdocs serve

# the package's map (docs/architecture/rooms.svg and rooms.txt) redrawn from the import graph; the suite checks it is
# fresh (tests/test_architecture.py), and `lint-imports` checks the floors it draws (.importlinter)
architecture:
	@$(PYTHON) -c "import grimp, matplotlib" 2>/dev/null || $(PYTHON) -m pip install -q -c constraints.txt -e ".[dev]"
	PYTHONPATH=. $(PYTHON) tools/architecture.py

bench: install-dev
	PYTHONPATH=. $(PYTHON) benchmarks/bench_trace.py   # the quick one; see benchmarks/README.md for the others

lint: install-dev
	$(PYTHON) -m ruff check hf_unlearn tests examples benchmarks
	PYTHONPATH=. lint-imports --config .importlinter --no-cache

clean:
	rm -rf build dist *.egg-info demo_output .pytest_cache trace_example trace_example_*proc trace_sft_example trace_sft_example_*proc unlearn_tofu_output masc_tofu_output random_label_output
