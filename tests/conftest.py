pytest_plugins = ["tests.fixtures.s3", "tests.fixtures.waiting", "tests.fixtures.temporal", "tests.fixtures.stack"]
