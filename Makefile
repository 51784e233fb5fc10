# Two commands do everything, set-up included:
#   make demo   the main job: trains the bundled GPT on CPU (torchrun, gloo, 4 processes), loss curve in runs/
#   make test   the test suite (CPU; GPU tests skip without CUDA)
VENV ?= .venv
PY := $(VENV)/bin/python
NPROC ?= 4
DEMO_ARGS ?= --pp 2 --tp 2 --microbatches 2

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
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) examples/train_gpt.py $(DEMO_ARGS)

# the unmodified model and fxmegatron side by side, loss by loss
tp-demo: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 examples/tp_demo.py

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

bench-capture: $(VENV)/.installed
	$(PY) benchmarks/capture_llama8b.py --tp 8

clean:
	rm -rf $(VENV) dump runs *.egg-info
