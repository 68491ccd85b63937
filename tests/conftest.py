pytest_plugins = ["tests.servers"]
