import os

import pytest
import torch
from helpers.claims import (  # noqa: F401 - hooks: a test docs/readme_claims.md names must not skip
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
    pytest_testnodedown,
)
from helpers.determinism import deterministic_from_env

os.environ.setdefault("MPLBACKEND", "Agg")
# two intra-op threads at most; one per worker when pytest-xdist runs several (make test: two workers on two cores)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(1 if _WORKERS > 1 else max(1, min(2, torch.get_num_threads())))
# processes the tests start (notebook and JupyterLab kernels, torchrun ranks, a second search) inherit this and compute
# on as many threads: at torch's default, one per core, two kernels beside each other oversubscribed the cores and ran
# the notebooks 4-10x slower under make test (benchmarks.ipynb 357 s with two threads, 72 s with one)
os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
deterministic_from_env()  # cuda_check.py --pytest: GPU tests compare bit for bit on deterministic kernels


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test that needs every zoo model's profile (``zoo_profiles``: about a minute of profiling per worker) is slow:
    ``make test`` runs it, ``make test-fast`` leaves it out."""
    for item in items:
        if "zoo_profiles" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


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
