# Two commands do everything, set-up included:
#   make demo   the main job: fxmegatron train examples/configs/gpt_tiny.toml on CPU (torchrun, gloo, 4 processes)
#   make test   the test suite (CPU; GPU tests skip without CUDA)
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 4
TEST_WORKERS ?= 2
DEMO_CONFIG ?= examples/configs/gpt_tiny.toml
DEMO_ARGS ?=

.PHONY: demo tp-demo test install bench-capture clean

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU wheel: an unpinned torch pulls several GB of CUDA packages
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) -m fxmegatron.train \
		$(DEMO_CONFIG) --set checkpoint.resume=none $(DEMO_ARGS)

# the unmodified model and fxmegatron side by side, loss by loss
tp-demo: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/tp_demo.py

# two test files at a time (pytest-xdist; a file's tests stay on one worker, so its module
# fixtures are built once): 37 min instead of 50 on 2 cores; TEST_WORKERS=0 runs one at a time
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

bench-capture: $(VENV)/.installed
	$(PY) benchmarks/capture_llama8b.py --tp 8

clean:
	rm -rf $(VENV) dump runs *.egg-info
