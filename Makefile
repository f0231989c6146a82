# Both `make demo` and `make test` build the same environment: .venv/ with every extra.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench clean tools

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq -c requirements/constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/xmem replay tests/data/snapshots/memory_files_memory_ctx128_forward.pickle

# helm, prometheus and promtool for the chart and observability tests, cached in .tools/.
tools:
	bash scripts/install-tools.sh

test: $(STAMP) tools
	$(PY) -m ruff check src tests bench examples
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check src tests bench examples

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
