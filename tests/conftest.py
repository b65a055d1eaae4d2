import os

import pytest
import torch

os.environ.setdefault("MPLBACKEND", "Agg")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``): they
    run several times faster than with two on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


@pytest.fixture(scope="session")
def ipython_shell():
    """IPython's global test shell, started once per session (``globalipapp.get_ipython`` imported by name before the
    first start would start it again, and get ``None``)."""
    from IPython.testing import globalipapp

    globalipapp.start_ipython()
    return globalipapp.get_ipython()
