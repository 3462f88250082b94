"""Suite-wide hypothesis settings.

The suite runs on small, shared machines next to real engines: example
generation and single examples may be slow there, which is not a defect of
the code under test.  Deadlines and the too-slow health checks are off for
every test; each test still sets its own ``max_examples``.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "kvindex",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("kvindex")
