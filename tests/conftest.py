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
    yield
    from kernels import dispatch

    settings._current = None  # the next current() re-reads the (restored) environment
    dispatch.use_backend("auto")
