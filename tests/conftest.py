import logging
import sys

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; runs on the GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_lightning():
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    yield


@pytest.fixture(autouse=True)
def _stop_stream_model_clocks():
    """A stream model's compute clock (a dispatch mode) never outlives its test
    (tests/stream_double.py, ``DoubleFactory`` used through ``override_stream_ops``)."""
    yield
    module = sys.modules.get("tests.stream_double")
    if module is not None:
        module.stop_lazy_clocks()
