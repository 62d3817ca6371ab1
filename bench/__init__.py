"""Benchmarks (`laminar bench`): measured, never asserted in tests; kept apart from the relay data plane."""
