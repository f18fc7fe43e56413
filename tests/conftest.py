"""Test set-up: MindSpore graph mode on CPU, fixed seeds, and a tmp checkpoint helper."""
import os

import numpy as np
import pytest


os.environ.setdefault("GLOG_v", "3")  # MindSpore: errors only

import mindspore as ms  # noqa: E402

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")


if os.environ.get("MINDVL_TEST_COMPILES"):  # graph compiles per test (tests/support/compile_count.py)
    from tests.support import compile_count

    compile_count.install()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        compile_count.set_test(item.nodeid)
        yield

    def pytest_terminal_summary(terminalreporter):
        compile_count.summary(terminalreporter)


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(0)
    ms.set_seed(0)
    yield
