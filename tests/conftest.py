import os

import pytest

# Tests never talk to a W&B server.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    yield


def pytest_addoption(parser):
    parser.addoption(
        "--layout-matrix", choices=("ci", "all"), default="ci",
        help="layout-equivalence cases to run: the CI sample (default) or the whole generated matrix",
    )
