"""Load signals: parsing vLLM /metrics text, garbage in, and fetching from a real HTTP server."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from scorer.load import LoadSnapshot, _collect, fetch_load, parse_vllm_metrics

# A /metrics page shaped like a vLLM 0.32 OpenAI server with two engine cores
# (data-parallel size 2) serving "tiny-llama", written from the metric names
# and types in vllm/v1/metrics/loggers.py; a second model's samples are mixed
# in to exercise the model filter.
VLLM_METRICS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
python_gc_objects_collected_total{generation="1"} 678.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.4e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny-llama"} 2.0
vllm:num_requests_running{engine="0",model_name="other-model"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny-llama"} 1.0
vllm:num_requests_waiting{engine="0",model_name="other-model"} 11.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason. Sum of all reasons equals vllm:num_requests_waiting.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="deferred"} 1.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="tiny-llama",reason="capacity"} 1.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="tiny-llama",sleep_state="awake"} 1.0
vllm:engine_sleep_state{engine="1",model_name="tiny-llama",sleep_state="awake"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="tiny-llama"} 0.25
vllm:kv_cache_usage_perc{engine="0",model_name="other-model"} 0.9
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 40960.0
vllm:prefix_cache_queries_total{engine="1",model_name="tiny-llama"} 8192.0
vllm:prefix_cache_queries_total{engine="0",model_name="other-model"} 100.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="tiny-llama"} 1.7645e+09
vllm:prefix_cache_queries_created{engine="1",model_name="tiny-llama"} 1.7645e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} 30720.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny-llama"} 4096.0
vllm:prefix_cache_hits_total{engine="0",model_name="other-model"} 50.0
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="tiny-llama"} 0.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny-llama"} 2.0
vllm:num_preemptions_total{engine="1",model_name="tiny-llama"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny-llama"} 52000.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny-llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny-llama"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny-llama"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny-llama"} 0.93
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",model_name="tiny-llama",num_gpu_blocks="1024",prefix_caching_hash_algo="sha256_cbor"} 1.0
"""


def test_realistic_page_all_models():
    s = parse_vllm_metrics(VLLM_METRICS)
    assert s.waiting == 16.0  # 4 + 1 + 11: summed over engines and models
    assert s.running == 12.0
    assert s.kv_usage == pytest.approx((0.5 + 0.25 + 0.9) / 3)
    assert s.prefix_cache_queries == 40960.0 + 8192.0 + 100.0
    assert s.prefix_cache_hits == 30720.0 + 4096.0 + 50.0
    assert s.engines == 3
    assert (s.in_flight, s.scraped_at) == (0, None)
    assert s.kv_capacity_tokens == 1024 * 32  # vllm:cache_config_info, engine 0 of tiny-llama only


def test_realistic_page_one_model():
    s = parse_vllm_metrics(VLLM_METRICS, model_name="tiny-llama")
    assert s == LoadSnapshot(
        waiting=5.0,
        running=5.0,
        kv_usage=0.375,  # mean of the two engine cores
        prefix_cache_queries=49152.0,
        prefix_cache_hits=34816.0,
        engines=2,
        kv_capacity_tokens=32768.0,
    )
    other = parse_vllm_metrics(VLLM_METRICS, model_name="other-model")
    assert (other.waiting, other.running, other.kv_usage, other.engines) == (11.0, 7.0, 0.9, 1)
    none = parse_vllm_metrics(VLLM_METRICS, model_name="not-served")
    assert none == LoadSnapshot()


def test_missing_metrics_give_zeros_and_none():
    assert parse_vllm_metrics("") == LoadSnapshot()
    only_waiting = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 3\n"
    s = parse_vllm_metrics(only_waiting)
    assert (s.waiting, s.running, s.kv_usage, s.prefix_cache_queries, s.prefix_cache_hits) == (3.0, 0.0, 0.0, None, None)
    assert s.engines == 1


def test_untyped_counters_and_legacy_names():
    # no TYPE lines at all, and the pre-0.10 gauge/counter names
    text = (
        'vllm:gpu_cache_usage_perc{model_name="m",engine="0"} 0.75\n'
        'vllm:gpu_prefix_cache_queries_total{model_name="m",engine="0"} 10\n'
        'vllm:gpu_prefix_cache_hits_total{model_name="m",engine="0"} 4\n'
        'vllm:num_requests_running{model_name="m",engine="0"} 1\n'
    )
    s = parse_vllm_metrics(text)
    assert (s.kv_usage, s.prefix_cache_queries, s.prefix_cache_hits, s.running) == (0.75, 10.0, 4.0, 1.0)
    # current names win over legacy ones
    both = text + 'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.125\n'
    assert parse_vllm_metrics(both).kv_usage == 0.125


def test_out_of_range_and_non_finite_values():
    text = (
        'vllm:kv_cache_usage_perc{engine="0"} 1.5\n'
        'vllm:num_requests_waiting{engine="0"} -2\n'
        'vllm:num_requests_waiting{engine="1"} NaN\n'
        'vllm:num_requests_running{engine="0"} +Inf\n'
    )
    s = parse_vllm_metrics(text)
    assert s.kv_usage == 1.0
    assert s.waiting == 0.0
    assert s.running == 0.0


@pytest.mark.parametrize(
    "garbage",
    [
        "hello world",
        'vllm:num_requests_waiting{engine="0" 3',
        "vllm:num_requests_waiting{engine=0} 3",
        "\x00\x01\x02",
        "vllm:kv_cache_usage_perc lots",
        "{} 1",
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.5 notatime\n',
    ],
)
def test_garbage_raises_value_error(garbage):
    with pytest.raises(ValueError):
        parse_vllm_metrics(garbage)


def test_non_str_is_a_type_error():
    with pytest.raises(TypeError):
        parse_vllm_metrics(VLLM_METRICS.encode())  # type: ignore[arg-type]


def _check_result_or_value_error(text: str) -> None:
    try:
        s = parse_vllm_metrics(text)
    except ValueError:
        return
    assert isinstance(s, LoadSnapshot)
    for v in (s.waiting, s.running, s.kv_usage):
        assert math.isfinite(v) and v >= 0.0
    assert s.kv_usage <= 1.0


_FRAGMENTS = st.sampled_from(
    [
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "{",
        "}",
        '="',
        '"',
        ",",
        "engine",
        "model_name",
        " ",
        "\n",
        "# TYPE ",
        "# HELP ",
        " counter",
        " gauge",
        " histogram",
        "1.5",
        "-3",
        "NaN",
        "+Inf",
        "1e400",
        "\\",
        "\\n",
        "le",
        "_bucket",
        "#",
        "\t",
        "\x00",
        "é",
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_arbitrary_text(text):
    _check_result_or_value_error(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(_FRAGMENTS, max_size=60).map("".join))
def test_fuzz_metric_shaped_text(text):
    _check_result_or_value_error(text)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cut=st.integers(0, len(VLLM_METRICS)),
    at=st.integers(0, len(VLLM_METRICS)),
    junk=st.text(max_size=8),
)
def test_fuzz_mutated_real_page(cut, at, junk):
    _check_result_or_value_error(VLLM_METRICS[:cut])
    _check_result_or_value_error(VLLM_METRICS[:at] + junk + VLLM_METRICS[at:])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cut=st.integers(0, len(VLLM_METRICS)),
    at=st.integers(0, len(VLLM_METRICS)),
    junk=st.text(max_size=8),
)
def test_line_selection_agrees_with_whole_page_parse(cut, at, junk):
    """Whenever the whole page parses, parsing only the selected lines gives the same snapshot."""
    for text in (VLLM_METRICS[:cut], VLLM_METRICS[:at] + junk + VLLM_METRICS[at:]):
        try:
            whole = _collect(text, None)
        except ValueError:
            continue
        assert parse_vllm_metrics(text) == whole


engine_values = st.fixed_dictionaries(
    {
        "waiting": st.integers(0, 1000),
        "running": st.integers(0, 1000),
        "usage": st.floats(0.0, 1.0),
        "queries": st.integers(0, 10**9),
        "hits": st.integers(0, 10**9),
        "blocks": st.sampled_from(["0", "1", "4096", "x", ""]),
        "block_size": st.sampled_from(["16", "64", "-1"]),
    }
)


@settings(max_examples=100, deadline=None)
@given(
    engines=st.dictionaries(
        st.tuples(st.sampled_from(["m1", "m2"]), st.sampled_from(["0", "1", "2", "3"])), engine_values, max_size=6
    ),
    model=st.none() | st.sampled_from(["m1", "m2"]),
)
def test_pages_written_by_prometheus_client_match_oracle(engines, model):
    """Pages produced by prometheus_client's own exposition writer, aggregated by a plain oracle."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    waiting = Gauge("vllm:num_requests_waiting", "w", labels, registry=reg)
    running = Gauge("vllm:num_requests_running", "r", labels, registry=reg)
    usage = Gauge("vllm:kv_cache_usage_perc", "u", labels, registry=reg)
    queries = Counter("vllm:prefix_cache_queries", "q", labels, registry=reg)
    hits = Counter("vllm:prefix_cache_hits", "h", labels, registry=reg)
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", labels, registry=reg)
    info = Gauge("vllm:cache_config_info", "c", ["block_size", "engine", "model_name", "num_gpu_blocks"],
                 registry=reg)
    for (m, e), v in engines.items():
        info.labels(v["block_size"], e, m, v["blocks"]).set(1)
        waiting.labels(m, e).set(v["waiting"])
        running.labels(m, e).set(v["running"])
        usage.labels(m, e).set(v["usage"])
        queries.labels(m, e).inc(v["queries"])
        hits.labels(m, e).inc(v["hits"])
        ttft.labels(m, e).observe(0.25)
    got = parse_vllm_metrics(generate_latest(reg).decode(), model_name=model)
    mine = [v for (m, _), v in engines.items() if model is None or m == model]
    assert got.engines == len(mine)
    assert got.waiting == sum(v["waiting"] for v in mine)
    assert got.running == sum(v["running"] for v in mine)
    if mine:
        assert got.kv_usage == pytest.approx(sum(v["usage"] for v in mine) / len(mine))
        assert got.prefix_cache_queries == sum(v["queries"] for v in mine)
        assert got.prefix_cache_hits == sum(v["hits"] for v in mine)
        caps = [int(v["blocks"]) * int(v["block_size"]) for v in mine
                if v["blocks"].isdigit() and int(v["blocks"]) > 0 and int(v["block_size"]) > 0]
        assert got.kv_capacity_tokens == (float(sum(caps)) if caps else None)
    else:
        assert got == LoadSnapshot()


# ---------------------------------------------------------------- fetching


async def _serve(handler):
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]  # the bound ephemeral port
    return runner, f"http://127.0.0.1:{port}"


def test_fetch_load_from_real_server():
    async def main():
        async def metrics(_request):
            return web.Response(text=VLLM_METRICS, content_type="text/plain")

        runner, url = await _serve(metrics)
        try:
            async with aiohttp.ClientSession() as session:
                before = asyncio.get_running_loop().time()
                s = await fetch_load(session, url, model_name="tiny-llama")
                s2 = await fetch_load(session, url + "/", timeout=5.0)
        finally:
            await runner.cleanup()
        return before, s, s2

    before, s, s2 = asyncio.run(main())
    assert (s.waiting, s.running, s.kv_usage, s.engines) == (5.0, 5.0, 0.375, 2)
    assert s.scraped_at is not None and s.scraped_at >= before  # asyncio's loop clock is time.monotonic
    assert s2.waiting == 16.0


def test_fetch_load_errors():
    async def main():
        async def broken(_request):
            return web.Response(status=500, text="boom")

        runner, url = await _serve(broken)
        errors = []
        try:
            async with aiohttp.ClientSession() as session:
                for kwargs in ({}, {"timeout": 0.0}):
                    try:
                        await fetch_load(session, url, **kwargs)
                    except Exception as exc:  # noqa: BLE001 - collected and checked below
                        errors.append(exc)
        finally:
            await runner.cleanup()

        async def garbage(_request):
            return web.Response(text="this is { not metrics", content_type="text/plain")

        runner, url = await _serve(garbage)
        try:
            async with aiohttp.ClientSession() as session:
                try:
                    await fetch_load(session, url)
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
        finally:
            await runner.cleanup()
        return errors

    errors = asyncio.run(main())
    assert len(errors) == 3
    assert isinstance(errors[0], aiohttp.ClientResponseError) and errors[0].status == 500
    assert isinstance(errors[1], ValueError)
    assert isinstance(errors[2], ValueError)
