"""Load signals of a pod, parsed from the engine's Prometheus ``/metrics`` text.

The parsing is pure (:func:`parse_vllm_metrics`); fetching is a thin asyncio
helper (:func:`fetch_load`).  Metric names and types mirror
vllm/v1/metrics/loggers.py (``PrometheusStatLogger``, vLLM 0.32), where every
metric is labelled ``model_name`` and ``engine`` (one ``engine`` value per
engine core of the server, i.e. per data-parallel rank behind one API server):

=================================  =======  ===================================
sample name                        type     LoadSnapshot field
=================================  =======  ===================================
vllm:num_requests_waiting          gauge    waiting (requests)
vllm:num_requests_running          gauge    running (requests)
vllm:kv_cache_usage_perc           gauge    kv_usage (fraction 0..1, not %)
vllm:prefix_cache_queries_total    counter  prefix_cache_queries (tokens)
vllm:prefix_cache_hits_total       counter  prefix_cache_hits (tokens)
vllm:cache_config_info             gauge    kv_capacity_tokens (labels
                                            num_gpu_blocks x block_size)
=================================  =======  ===================================

Engines older than vLLM 0.10 called the usage gauge
``vllm:gpu_cache_usage_perc`` and the counters ``vllm:gpu_prefix_cache_*``;
those names are read as a fallback when the current ones are absent.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:  # pragma: no cover - typing only
    import aiohttp

__all__ = ["LoadSnapshot", "fetch_load", "parse_vllm_metrics"]


class LoadSnapshot(msgspec.Struct, kw_only=True):
    """Load of one pod (one engine endpoint) at one moment.

    Fields:
        waiting: requests queued in the scheduler (``vllm:num_requests_waiting``),
            summed over the server's engine cores.
        running: requests in execution batches (``vllm:num_requests_running``),
            summed over engine cores.
        kv_usage: fraction of KV-cache blocks in use, 0..1
            (``vllm:kv_cache_usage_perc``), the mean over engine cores.
        in_flight: requests the router itself has sent to this pod and not yet
            seen finish (the router's own count; the parser leaves it 0).
        prefix_cache_queries: cumulative prompt tokens looked up in the prefix
            cache (``vllm:prefix_cache_queries_total``, summed over engine
            cores), None when the engine does not expose it.
        prefix_cache_hits: cumulative prompt tokens found there
            (``vllm:prefix_cache_hits_total``), None when absent.
        scraped_at: ``time.monotonic()`` seconds of the scrape (set by
            :func:`fetch_load`; None from the pure parser).
        engines: number of distinct engine cores (``engine`` label values) seen
            in the text; 0 when none of the load metrics was present.
        prefill_tokens: router-side estimate of the prompt tokens the pod
            still has to prefill for the requests the router sent it (those
            that have not produced a first token yet), None when the router
            does not track it (the parser leaves it None; see
            ``kvindex.Indexer.request_started``).  Read by
            :class:`scorer.picker.TTFTPicker`.
        kv_capacity_tokens: the pod's KV cache size in tokens (vLLM's
            ``num_gpu_blocks x block_size``, labels of
            ``vllm:cache_config_info``), None when unknown; with
            ``kv_usage`` it gives the free KV :class:`scorer.picker.TTFTPicker`
            checks a request against.

    Missing metrics give zeros (None for the counters).  Use
    ``msgspec.structs.replace(snap, in_flight=n)`` to add the router's count.
    """

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    scraped_at: float | None = None
    engines: int = 0
    prefill_tokens: float | None = None
    kv_capacity_tokens: float | None = None


_WAITING = ("vllm:num_requests_waiting",)
_RUNNING = ("vllm:num_requests_running",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_CACHE_INFO = "vllm:cache_config_info"
_WANTED = frozenset(_WAITING + _RUNNING + _KV_USAGE + _QUERIES + _HITS + (_CACHE_INFO,))
_FAMILIES = _WANTED | {n.removesuffix("_total") for n in _WANTED}

# Lines that can matter: samples of the wanted names and their HELP/TYPE
# comments.  Only these go through the (slow, ~0.1 ms/line) exposition parser;
# a vLLM page holds hundreds of histogram bucket lines that would not be read.
_NAMES_RE = "|".join(re.escape(n) for n in sorted(_FAMILIES, key=len, reverse=True))
_RELEVANT = re.compile(
    rf"^[ \t]*(?:(?:{_NAMES_RE})(?:[{{ \t].*)?|#[ \t]+(?:HELP|TYPE)[ \t]+(?:{_NAMES_RE})(?:[ \t].*)?)$",
    re.MULTILINE,
)


def _first_present(values: dict[str, list[tuple[str, float]]], names: Iterable[str]) -> list[tuple[str, float]] | None:
    for n in names:
        got = values.get(n)
        if got:
            return got
    return None


def parse_vllm_metrics(text: str, *, model_name: str | None = None) -> LoadSnapshot:
    """Parse a vLLM server's ``/metrics`` text into a :class:`LoadSnapshot`.

    Built on ``prometheus_client.parser.text_string_to_metric_families``; only
    the samples listed in the module table are read.  For speed, only the
    lines of those metrics (samples and their ``# HELP``/``# TYPE`` lines,
    selected by name) are handed to the parser when the page has any: lines
    of other metrics are neither read nor validated.  A page without any of
    them is parsed whole, so text that is not exposition text raises.

    Aggregation over label sets (several ``engine`` values are the engine cores
    of one server, e.g. ``--data-parallel-size`` > 1 behind one API server):
    waiting, running, the two counters and the KV capacity are **summed**
    (an engine core's capacity is the ``num_gpu_blocks`` label times the
    ``block_size`` label of its ``vllm:cache_config_info``; a sample without
    both as positive integers is skipped); kv_usage is the
    **mean** over engine cores (vLLM gives every DP rank an equally sized KV
    pool and its DP coordinator balances requests across ranks, so the mean is
    the fraction of the server's KV in use).  Samples are keyed by their
    ``engine`` label; a sample without one counts as one engine.

    Args:
        text: the exposition text (Prometheus text format 0.0.4).
        model_name: when given, only samples whose ``model_name`` label equals
            it are read (a sample without that label is skipped); None = all.

    Returns:
        A LoadSnapshot with ``in_flight=0`` and ``scraped_at=None``.  Metrics
        that are absent give 0 (None for the counters).  Non-finite sample
        values (NaN, +-Inf) are skipped; negative gauges are raised to 0 and
        kv_usage is clamped to 0..1.

    Raises:
        ValueError: the text is not valid exposition text (any parser failure
            is re-raised as ValueError with the cause chained).
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"metrics text must be str, got {type(text).__name__}")
    selected = [m.group(0) for m in _RELEVANT.finditer(text)]
    # Fast path: parse only the relevant lines.  When there are none, parse the
    # whole text so that a body that is no exposition text at all (an HTML
    # error page, a truncated frame) is reported as ValueError.
    return _collect("\n".join(selected) + "\n" if selected else text, model_name)


def _collect(text: str, model_name: str | None) -> LoadSnapshot:
    """Run the exposition parser over ``text`` and aggregate the wanted samples."""
    values: dict[str, list[tuple[str, float]]] = {}
    engines: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name
                if name not in _WANTED:
                    continue
                labels = sample.labels
                if model_name is not None and labels.get("model_name") != model_name:
                    continue
                if name == _CACHE_INFO:
                    v = _capacity(labels)
                    if v is None:
                        continue
                else:
                    v = float(sample.value)
                if not math.isfinite(v):
                    continue
                engine = labels.get("engine", "")
                # one engine = its engine label within one model
                key = f"{labels.get('model_name', '')}\x00{engine}"
                values.setdefault(name, []).append((key, v))
                engines.add(key)
    except ValueError:
        raise
    except Exception as exc:  # the parser raises assorted types on garbage
        raise ValueError(f"invalid Prometheus exposition text: {exc!r}") from exc

    def total(names: tuple[str, ...]) -> float | None:
        got = _first_present(values, names)
        return None if got is None else math.fsum(v for _, v in got)

    waiting = total(_WAITING) or 0.0
    running = total(_RUNNING) or 0.0
    usage_samples = _first_present(values, _KV_USAGE)
    if usage_samples:
        per_engine: dict[str, float] = {}
        for key, v in usage_samples:
            per_engine[key] = v  # a repeated label set: the last one wins
        kv = math.fsum(per_engine.values()) / len(per_engine)
    else:
        kv = 0.0
    capacity: float | None = None
    cap_samples = values.get(_CACHE_INFO)
    if cap_samples:
        per_engine_cap: dict[str, float] = {}
        for key, v in cap_samples:
            per_engine_cap[key] = v  # a repeated label set: the last one wins
        capacity = math.fsum(per_engine_cap.values())
    return LoadSnapshot(
        waiting=max(0.0, waiting),
        running=max(0.0, running),
        kv_usage=min(1.0, max(0.0, kv)),
        prefix_cache_queries=total(_QUERIES),
        prefix_cache_hits=total(_HITS),
        engines=len(engines),
        kv_capacity_tokens=capacity,
    )


def _capacity(labels: dict[str, str]) -> float | None:
    """KV tokens of one engine core from ``vllm:cache_config_info`` labels, or None."""
    try:
        blocks = int(labels.get("num_gpu_blocks", ""))
        size = int(labels.get("block_size", ""))
    except ValueError:
        return None
    return float(blocks * size) if blocks > 0 and size > 0 else None


async def fetch_load(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout: float = 1.0,
    model_name: str | None = None,
) -> LoadSnapshot:
    """GET ``{url}/metrics`` and parse it with :func:`parse_vllm_metrics`.

    Args:
        session: an open aiohttp session (the caller owns it).
        url: the engine's base URL, e.g. ``http://10.0.0.5:8000`` (a trailing
            ``/`` is fine).
        timeout: total timeout of the request, seconds (> 0).
        model_name: passed to the parser.

    Returns:
        The snapshot with ``scraped_at = time.monotonic()`` taken when the
        response body has been read.

    Raises:
        aiohttp.ClientResponseError: non-2xx status.
        aiohttp.ClientError: connection errors.
        TimeoutError: no complete answer within ``timeout``.
        ValueError: ``timeout <= 0`` or the body is not exposition text.
    """
    import aiohttp

    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    async with session.get(
        url.rstrip("/") + "/metrics",
        timeout=aiohttp.ClientTimeout(total=timeout),
        headers={"Accept": "text/plain"},
    ) as resp:
        resp.raise_for_status()
        body = await resp.text()
    scraped = time.monotonic()
    snap = parse_vllm_metrics(body, model_name=model_name)
    return msgspec.structs.replace(snap, scraped_at=scraped)
