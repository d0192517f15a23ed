"""Suite-wide settings: nothing may depend on how fast or loaded the machine is."""

from hypothesis import HealthCheck, settings

# Hypothesis' defaults time each example (200 ms deadline) and fail a test
# whose data generation is slow: both trip on a loaded 2-core CI machine.
# Tests' own @settings keep this for whatever they leave unset.
settings.register_profile("kvoffload", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvoffload")
