"""Suite-wide hypothesis settings.

The suite runs on small, shared machines next to real engines: example
generation and single examples may be slow there, which is not a defect of
the code under test.  Deadlines and the too-slow health checks are off for
every test; each test still sets its own ``max_examples``.

Under CI (``CI`` set in the environment) the examples are derandomized: each
test draws the same examples on every run, so a CI result is reproducible
from a clean clone.  Local runs draw new examples each time and keep the
failures they find in ``.hypothesis/``.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvindex",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("kvindex-ci", parent=settings.get_profile("kvindex"), derandomize=True, database=None)
settings.load_profile("kvindex-ci" if os.environ.get("CI") else "kvindex")


# -- a real Redis server for the Redis backend's tests (see tests/redis_server.py)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def redis_server():
    """One ``redis-server`` for the session on a free loopback port (persistence off).

    Fails (never skips) when the binary is missing: ``.ci/run`` installs it.
    """
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session server's URL, its data flushed before the test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url
