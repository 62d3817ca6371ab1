"""Environments: what a run trains on. `envs/tasks/` (prompts plus a reward, the built-in tasks, the task
loader) and `envs/tools/` (tools a multi-turn episode calls, the Python sandbox included).

Imports only `laminar/` and itself; `rl/`, `services/` and the commands import it (tests/test_layering.py).
"""
