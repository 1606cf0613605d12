import logging
import os
import sys

import pytest
import torch

#: The long run (docs/development.md): ``LSWAP_LONG=1`` runs the tests marked ``long``, the rest
#: of each broad sweep beyond the cases the default run keeps, soaks and repetitions. The one
#: switch; besides the marker, only tests/adapters/test_fsdp.py reads it (to add a case to the
#: one 2-process job it starts per model, which a marker on a test cannot do).
LONG = os.environ.get("LSWAP_LONG") == "1"


def pytest_collection_modifyitems(config, items):
    for item in items:
        mark = item.get_closest_marker("long")
        if mark is not None and not LONG:
            what = mark.args[0] if mark.args else "the rest of a sweep"
            item.add_marker(pytest.mark.skip(reason=f"{what}: the long run, LSWAP_LONG=1"))
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
