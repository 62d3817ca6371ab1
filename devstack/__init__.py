"""The embedded dev stack for a laptop and the tests: a Temporal dev server and an S3 server, with what
they record in `<home>/dev.json` (devstack.record). Deployment code never needs more than the record."""
