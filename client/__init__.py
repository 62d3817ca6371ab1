"""What every program uses to reach a deployment: settings, connect, run operations, watch_run."""
