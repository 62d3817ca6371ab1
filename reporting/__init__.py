"""What a run's records add up to, for people: the run summary, the time breakdown and `laminar report`'s plots
and page; read through storage/records.py, used by workers/ (the CLI) and bench/ alike."""
