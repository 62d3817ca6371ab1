pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.waiting", "tests.fixtures.temporal", "tests.fixtures.stack"]


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_relay_breakers():
    """Each test starts with no relay verdicts: the breaker registry is process-wide (relay/breaker.py), and a port
    a stopped relay leaves behind may be reused by the next test's relay."""
    from laminar.relay.breaker import BREAKERS

    BREAKERS.clear()
    yield


@pytest.fixture(autouse=True)
def _logging_as_found():
    """A command run in process (typer's CliRunner) configures logging for the process, with cached loggers
    (laminar/logs.py); undo it after the test so a later test's `structlog.testing.capture_logs` sees every event."""
    yield
    import structlog

    from laminar import logs

    if logs._configured:
        structlog.reset_defaults()
        logs._configured = False
