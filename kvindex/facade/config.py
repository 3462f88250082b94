"""One typed configuration for the whole indexer, loadable from JSON or YAML.

Names are snake_case and follow llm-d's KV-cache manager configuration where
it has an equivalent (``token_processor_config.block_size``, ``hash_seed``,
``kv_block_index_config.in_memory_config.size``,
``kv_events_config.zmq_endpoint`` / ``concurrency``; llm-d's ``topicFilter``
is the per-engine ``topic``).

Example (YAML)::

    model_name: tiny-llama
    token_processor_config:
      block_size: 16
      hash_seed: 0                   # int or str (0 and "0" are different seeds)
      algorithm: xxh3_chain          # or vllm_sha256_cbor / vllm_sha256
    kv_block_index_config:
      backend: auto                  # native when compiled, else python; or name one
      in_memory_config: {size: 1000000, max_orphan_blocks: 100000}
      redis_config: {url: "redis://127.0.0.1:6379/0"}   # backend: redis only
    kv_events_config:
      concurrency: 4
      engines:
        - {pod: pod-a, endpoint: "tcp://10.0.0.5:5557", replay_endpoint: "tcp://10.0.0.5:5558"}
    scorer_config:
      tier_weights: {gpu: 1.0, cpu: 0.8, storage: 0.5}
      weights: {prefix: 3.0, kv_usage: 2.0, queue: 2.0}

Unknown keys are rejected (a typo should not silently fall back to a default).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvevents.subscriber import EngineEndpoint, check_endpoint, check_engine
from kvindex.keys import ALGORITHMS
from kvindex.factory import BACKENDS
from kvevents.pool import DECODERS
from kvindex.tiers import DEFAULT_TIER_WEIGHTS, TierWeights

ENGINE_FORMATS = tuple(DECODERS)

__all__ = [
    "Config",
    "TokenProcessorConfig",
    "InMemoryConfig",
    "KVBlockIndexConfig",
    "RedisConfig",
    "KVEventsConfig",
    "ScorerWeights",
    "ScorerConfig",
    "load_config",
]


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class TokenProcessorConfig(_Base, frozen=True):
    """How tokens become request keys (see kvindex.keys.TokenProcessor).

    block_size: tokens per block; must equal the engines' block size.
    hash_seed: seed of our keyed hash (int or str); every router of a fleet
        that shares an index must use the same one.
    algorithm: ``xxh3_chain`` (ours) or ``vllm_sha256_cbor`` / ``vllm_sha256``
        (reproduce the engines' own block hashes).
    engine_hash_seed: for the vllm_* algorithms, the engines' PYTHONHASHSEED
        (None: vLLM's default seed string).
    lora_paths: for the vllm_* algorithms, LoRA adapter name -> the path the
        engines loaded it from (vLLM hashes the path too).
    hash_lookahead_tokens: the engines' ``num_hash_lookahead_tokens`` (vLLM
        0.33+ with EAGLE-style speculative decoding and prefix caching): each
        block's hash covers that many following tokens and the prompt's last
        blocks are not hashed; 0 (default) for engines without it.
    """

    block_size: int = 16
    hash_seed: int | str = 0
    algorithm: str = "xxh3_chain"
    engine_hash_seed: str | None = None
    lora_paths: dict[str, str] = msgspec.field(default_factory=dict)
    hash_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.hash_lookahead_tokens < 0:
            raise ValueError(f"hash_lookahead_tokens must be >= 0, got {self.hash_lookahead_tokens}")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")


class InMemoryConfig(_Base, frozen=True):
    """In-memory backend bounds: ``size`` request keys (LRU), orphan blocks."""

    size: int = 1_000_000
    max_orphan_blocks: int = 100_000


class RedisConfig(_Base, frozen=True):
    """The shared index in Redis (backend ``redis``; see kvindex.redis_index).

    url: ``redis://host:port/db`` of the server every router replica uses.
    key_prefix: prefix of the index's keys (replicas of one fleet use the same).
    held_ttl: seconds a pod's decode-retained (held) entries live after its
        last add (None: until removed).
    socket_timeout: seconds per call; retry_interval: seconds calls fail fast
        after an error (reads then answer without prefix information).
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvindex:{default}:"
    held_ttl: float | None = 480.0
    socket_timeout: float = 2.0
    retry_interval: float = 0.5

    def __post_init__(self) -> None:
        if not self.key_prefix:
            raise ValueError("redis_config.key_prefix must not be empty")
        if not 0 < self.socket_timeout < 3600 or not 0 <= self.retry_interval < 3600:
            raise ValueError("redis_config: socket_timeout in (0, 3600) s, retry_interval in [0, 3600) s")


class KVBlockIndexConfig(_Base, frozen=True):
    """Index implementation and bounds.

    backend: ``"auto"`` (the default: ``"native"`` when the compiled core is
    installed, else ``"python"``, logged once), ``"python"``
    (:class:`kvindex.reference.KVBlockIndex`, the reference), ``"native"``
    (:class:`kvindex.native.NativeKVBlockIndex`, the compiled core) or
    ``"redis"`` (:class:`kvindex.redis_index.RedisKVBlockIndex`, one index
    shared by router replicas, configured by ``redis_config``); a named
    backend never falls back to another.  ``in_memory_config.size`` bounds the
    request keys of every backend.
    """

    backend: str = "auto"
    in_memory_config: InMemoryConfig = msgspec.field(default_factory=InMemoryConfig)
    redis_config: RedisConfig = msgspec.field(default_factory=RedisConfig)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


class KVEventsConfig(_Base, frozen=True):
    """Write path: where events come from and how the pool applies them.

    engines: connect mode, one entry per engine endpoint (engines bind).
    zmq_endpoint: bind mode address (engines dial in), e.g. ``tcp://*:5557``.
    Every endpoint is checked here (ValueError naming the field, e.g.
    ``kv_events_config.engines[0].endpoint``): ``tcp://host:port``,
    ``ipc://path`` or ``inproc://name``; a wildcard host (``tcp://*:port``)
    only in ``zmq_endpoint``, which we bind.
    bind_replay: bind mode: pod -> replay endpoint (DP rank 0; rank r at port + r).
    engine: payload format in bind mode (``vllm`` or ``sglang``).
    concurrency: pool shards; queue_size: per-shard bound in messages;
    replay_timeout: seconds; replay_retries / replay_retry_max_delay: how
    often in a row, and at most how far apart (seconds, from 0.05 s doubling),
    a replay that failed without applying anything is asked again (see
    :class:`kvevents.pool.EventPool`).
    rejoin_checks: after a subscription (re)joins, how many more times
    (0.2 s apart, doubling) the engine's replay buffer is asked until the
    engine's first live message (a batch published between the handshake
    and the publisher taking the subscription is lost live; see
    :class:`kvevents.pool.EventPool`).
    connect_timeout: seconds one TCP connection attempt to an engine may
        take (then it counts as failed and is retried in the background).
        :meth:`kvindex.Indexer.start` waits only while first attempts are in
        flight: a reachable engine answers and a refusing one fails within
        milliseconds, so only an address that drops packets makes it wait,
        this long at most (0: no wait, the OS's connect timeout).  An engine
        up when start() returns has had its bootstrap replay queued, so a
        ``flush()`` then covers what it buffers; the others are named in a
        warning (``Indexer.wait_connected`` waits for them).
    """

    engines: list[EngineEndpoint] = msgspec.field(default_factory=list)
    zmq_endpoint: str | None = None
    bind_replay: dict[str, str] = msgspec.field(default_factory=dict)
    engine: str = "vllm"
    concurrency: int = 4
    queue_size: int = 10_000
    replay_timeout: float = 2.0
    replay_retries: int = 10
    replay_retry_max_delay: float = 5.0
    rejoin_checks: int = 6
    connect_timeout: float = 5.0

    def __post_init__(self) -> None:
        for eng in [self.engine, *(e.engine for e in self.engines)]:
            if eng not in ENGINE_FORMATS:
                raise ValueError(f"engine must be one of {ENGINE_FORMATS}, got {eng!r}")
        if self.concurrency < 1 or self.queue_size < 1:
            raise ValueError("concurrency and queue_size must be >= 1")
        if not 0 < self.replay_timeout < 3600:
            raise ValueError(f"replay_timeout must be in (0, 3600) seconds, got {self.replay_timeout}")
        if self.replay_retries < 0:
            raise ValueError(f"replay_retries must be >= 0, got {self.replay_retries}")
        if not 0.05 <= self.replay_retry_max_delay < 3600:
            raise ValueError(f"replay_retry_max_delay must be in [0.05, 3600) seconds, got {self.replay_retry_max_delay}")
        if self.rejoin_checks < 0:
            raise ValueError(f"rejoin_checks must be >= 0, got {self.rejoin_checks}")
        if not 0 <= self.connect_timeout < 3600:
            raise ValueError(f"connect_timeout must be in [0, 3600) seconds, got {self.connect_timeout}")
        for i, eng in enumerate(self.engines):
            check_engine(eng, f"kv_events_config.engines[{i}]")
        if self.zmq_endpoint is not None:
            check_endpoint(self.zmq_endpoint, "kv_events_config.zmq_endpoint", bind=True)
        for pod, ep in self.bind_replay.items():
            check_endpoint(ep, f"kv_events_config.bind_replay[{pod!r}]")
        pods = [e.pod for e in self.engines]
        if len(set(pods)) != len(pods):
            raise ValueError("each engine entry needs its own pod id (use dp_size for DP ranks)")


class ScorerWeights(_Base, frozen=True):
    """Picker weights (llm-d benchmark defaults: prefix 3 : kv-usage 2 : queue 2)."""

    prefix: float = 3.0
    kv_usage: float = 2.0
    queue: float = 2.0

    def __post_init__(self) -> None:
        for name in ("prefix", "kv_usage", "queue"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"picker weight {name!r} must be finite and >= 0, got {v}")


class ScorerConfig(_Base, frozen=True):
    """Read path: tier weights, picker, speculative entries.

    picker: ``weighted`` (scorer.picker.WeightedPicker, with ``weights``) or
    ``ttft`` (scorer.picker.TTFTPicker: the pod with the lowest estimated
    time to first token, with ``kv_pressure``, and the KV-overflow term
    ``kv_stall`` x overflow, off by default, with ``decode_reserve``).
    speculative_ttl: seconds a request's blocks count as present on the pod
    ``Indexer.route`` chose, until the engine's events confirm them (0
    disables; ``score`` alone never marks anything).

    The defaults (``ttft``, kv_pressure 10, speculative_ttl 5 s) won the
    fleet simulator's seed-002 comparison (bench/sim/README.md); ``weighted``
    with prefix 3 : kv-usage 2 : queue 2 is llm-d's benchmark setting.
    """

    tier_weights: dict[str, float] = msgspec.field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS))
    picker: str = "ttft"
    weights: ScorerWeights = msgspec.field(default_factory=ScorerWeights)
    kv_pressure: float = 10.0
    kv_stall: float = 0.0
    decode_reserve: float = 16.0
    speculative_ttl: float = 5.0

    def __post_init__(self) -> None:
        if self.picker not in ("weighted", "ttft"):
            raise ValueError(f"picker must be 'weighted' or 'ttft', got {self.picker!r}")
        if not (math.isfinite(self.kv_pressure) and self.kv_pressure >= 0):
            raise ValueError(f"kv_pressure must be finite and >= 0, got {self.kv_pressure}")
        if not (math.isfinite(self.kv_stall) and self.kv_stall >= 0):
            raise ValueError(f"kv_stall must be finite and >= 0, got {self.kv_stall}")
        if not (math.isfinite(self.decode_reserve) and self.decode_reserve >= 0):
            raise ValueError(f"decode_reserve must be finite and >= 0, got {self.decode_reserve}")
        if not 0 <= self.speculative_ttl < 86_400:
            raise ValueError(f"speculative_ttl must be in [0, 86400) seconds, got {self.speculative_ttl}")
        TierWeights(self.tier_weights)  # raises for negative or non-finite weights


class Config(_Base, frozen=True):
    """Everything the :class:`kvindex.Indexer` needs.

    model_name: default model for ``score()`` (keys are scoped by model; the
    engines' topics ``kv@<pod>@<model>`` name theirs).
    """

    model_name: str | None = None
    token_processor_config: TokenProcessorConfig = msgspec.field(default_factory=TokenProcessorConfig)
    kv_block_index_config: KVBlockIndexConfig = msgspec.field(default_factory=KVBlockIndexConfig)
    kv_events_config: KVEventsConfig = msgspec.field(default_factory=KVEventsConfig)
    scorer_config: ScorerConfig = msgspec.field(default_factory=ScorerConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Validate a plain mapping. Raises msgspec.ValidationError (a ValueError) on bad input."""
        return msgspec.convert(data, cls)

    @classmethod
    def from_json(cls, text: str | bytes) -> Config:
        """Parse JSON text. Raises msgspec.DecodeError / ValidationError."""
        return msgspec.json.decode(text, type=cls)

    @classmethod
    def from_yaml(cls, text: str) -> Config:
        """Parse YAML text (safe loader). Raises ValueError for YAML that is not a mapping."""
        data = yaml.safe_load(text)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError("configuration must be a mapping")
        return cls.from_dict(data)

    def to_json(self) -> bytes:
        """The configuration as JSON."""
        return msgspec.json.encode(self)


def load_config(path: str | Path) -> Config:
    """Load a configuration file: ``.json`` as JSON, anything else as YAML."""
    p = Path(path)
    text = p.read_text()
    return Config.from_json(text) if p.suffix == ".json" else Config.from_yaml(text)
