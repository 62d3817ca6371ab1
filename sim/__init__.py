"""`laminar simulate` and `laminar plan`: a discrete-event simulator of Laminar and its baselines at GPU scale.

It asks the project's own code for every scheduling decision (laminar/policy.py, workflows/repack.py,
workflows/ledger.py) and charges time through rl/costs.py, the modelled engine's cost functions. Parameters:
sim/params.py. Imports laminar/, workflows/, rl/ and itself only.
"""
