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
