"""The Python client of a deployment, for every process and program: where things are (LAMINAR_* settings),
connecting to Temporal and the store, starting and watching runs. Imports nothing from workers/."""
