"""Laminar on Temporal: shared core (config, the Temporal contract, errors, refs, records, logging, the run-mode
policy).

This package holds only light, deterministic types that every other package may import,
including Temporal workflow code (no torch, no boto3, no I/O at import time).
"""

__version__ = "0.1.0"
