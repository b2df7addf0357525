"""Shared test fixtures."""

import json

import pytest

from runtime import settings


@pytest.fixture
def use_options(monkeypatch):
    """`use_options(dispatch="host", ...)`: run this test under those RuntimeOptions, in this process and in
    the rank processes it starts (through DATAFLOW_OPTIONS, the one environment override)."""

    def set_options(**values):
        settings.options_from(values, "use_options")  # a typo fails here, not in a child
        monkeypatch.setenv(settings.ENV_OPTIONS, json.dumps(values))
        return settings.current()

    return set_options


@pytest.fixture(autouse=True)
def _default_options_after_each_test():
    """A command run in-process (`dataflow run --set ...` through CliRunner) installs its options with
    settings.configure, which exports DATAFLOW_OPTIONS: each test starts from the environment it found."""
    import os

    before = os.environ.get(settings.ENV_OPTIONS)
    yield
    from dataflow_kernels import dispatch

    if before is None:
        os.environ.pop(settings.ENV_OPTIONS, None)
    else:
        os.environ[settings.ENV_OPTIONS] = before
    settings._current = None  # the next current() re-reads the (restored) environment
    dispatch.use_backend("auto")
