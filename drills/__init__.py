"""`laminar drill`: one fault injected into a live run, and a report of how the run recovered. The workflow that
sequences a drill (workflow.py: deterministic, no I/O), the rules that find the target and work out the report
(rules.py: pure), the activities that observe the run from the drill's own process (observer.py), the fault a
worker delivers to itself (faults.py), and the command that ties them together (command.py); the command line is
cli/main.py's `drill`."""
