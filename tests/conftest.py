import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def toy_path(tmp_path_factory) -> str:
    """A fresh toy checkpoint, written by exactly the command users run."""
    import subprocess

    out = tmp_path_factory.mktemp("toy") / "ckpt"
    subprocess.run([sys.executable, "-m", "ouro_backend.model.toy", "--out", str(out)], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return str(out)


@pytest.fixture(scope="session")
def toy_weights(toy_path):
    import torch

    from ouro_backend.model.checkpoint import load_config, load_weights

    cfg = load_config(toy_path)
    return cfg, load_weights(toy_path, cfg, torch.float32, "cpu")


@pytest.fixture(scope="session")
def oracle(toy_weights):
    from ouro_backend.model.oracle import DenseOracle

    return DenseOracle(*toy_weights)
