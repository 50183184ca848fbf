def pytest_configure(config):
    # Also registered for the whole suite by the compile-only CI leg's configuration.
    config.addinivalue_line(
        "markers", "compile_only: compiles for an H100 / TPU target without the device"
    )
