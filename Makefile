# The two commands of the README: `make demo` and `make test`. Both set up a venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 resolves to the CPU wheel on this kind of machine; override for CUDA builds.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: install demo test test-fast bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH_SPEC)"
	touch $@

demo: install
	$(VENV)/bin/tapioca demo $(ARGS)

test: install
	$(PY) -m pytest $(ARGS)

test-fast: install
	$(PY) -m pytest -m "not integration and not e2e" $(ARGS)

bench: install
	$(PY) benchmarks/bus_throughput.py

clean:
	rm -rf $(VENV) runs
