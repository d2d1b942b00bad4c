"""Shared pytest configuration: one deterministic hypothesis profile for the whole suite."""

from hypothesis import settings

settings.register_profile("opake", derandomize=True, max_examples=50, deadline=None, print_blob=True)
settings.load_profile("opake")
