"""Discrete-event fleet simulator for comparing routing policies.

Nothing in the library imports this package.  Simulated vLLM pods
(:mod:`bench.sim.engine`) run continuous batching with chunked prefill,
prefix caching and LRU eviction on simulated time, and publish vLLM 0.32
KV-event batches (:mod:`bench.sim.wire`) that go through the library's real
decoder, :class:`kvevents.EventPool` and :class:`kvindex.KVBlockIndex`
(in process, or over ZMQ).  Schedulers (:mod:`bench.sim.schedulers`) read
that index through the library's scorer.  :mod:`bench.sim.cluster` runs one
workload under one scheduler; :mod:`bench.sim.__main__` runs the sweeps and
writes tables, JSON and PNG to ``bench/out/``.
"""
