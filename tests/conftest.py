"""Test set-up: MindSpore graph mode on CPU, fixed seeds, and a tmp checkpoint helper."""
import os

import numpy as np
import pytest


os.environ.setdefault("GLOG_v", "3")  # MindSpore: errors only

import mindspore as ms  # noqa: E402

ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")


@pytest.fixture(autouse=True)
def _seed():
    np.random.seed(0)
    ms.set_seed(0)
    yield
