import os

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def zoo_profiles():
    """Profiles of every zoo model (built once per test session): name -> (ZooModel, optimizer, profile)."""
    import memopt_nb as memopt

    out = {}
    for name in memopt.zoo.MODELS:
        zm = memopt.zoo.build(name)
        opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
        out[name] = (zm, opt, memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1))
    return out
