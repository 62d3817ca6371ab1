"""Laminar on Temporal. `laminar` is the one installed top-level name; its subpackages are the repository's
top-level folders (`laminar.workflows` is `workflows/`, `laminar.rl` is `rl/`, and so on).

The modules directly in this folder are the shared core (config, the Temporal contract, errors, refs, records,
logging, the run-mode policy): light, deterministic types that every other package may import, workflow code
included (no torch, no boto3, no I/O at import time).
"""

import os as _os

__version__ = "0.1.0"

# The subpackages, in the order the layering rules list them (tests/test_layering.py, pyproject's package-dir).
SUBPACKAGES = ("cli", "client", "chaos", "drills", "devstack", "workflows", "activities", "workers", "storage", "rl",
               "envs", "relay", "services", "bench", "reporting", "sim")

# A wheel installs the subpackages inside this folder; a source checkout keeps them beside it. So the folder above
# is searched after this one (string arithmetic only: the workflow sandbox re-imports this module and forbids I/O).
__path__.append(_os.path.dirname(_os.path.dirname(__file__)))  # noqa: F821 (the package's own)
