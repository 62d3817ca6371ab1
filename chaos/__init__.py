"""`laminar chaos`: a run under a seeded schedule of overlapping faults that all heal, judged from its durable
records at the end. The schedule (schedule.py: pure and seeded), the nemesis that carries it out against the live
processes (nemesis.py), the checker that judges the run (checker.py), and the command that ties them together
(command.py); the command line is cli/chaos.py."""
