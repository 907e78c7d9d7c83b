"""The routing tests run torch on one thread (see tests/conftest.py `one_torch_thread`)."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield
