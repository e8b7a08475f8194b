import pytest
import torch
import torch.distributed as dist

from verl_longstraw.tiny import DENSE_VARIANTS, FAMILIES, VARIANTS, unavailable

torch.set_num_threads(min(2, torch.get_num_threads()))

TINY_FAMILIES = frozenset((*FAMILIES, *DENSE_VARIANTS, *VARIANTS))


def pytest_collection_modifyitems(items):
    """A test parametrized with a tiny family the installed transformers lacks is skipped, naming why
    (``tiny.unavailable``; scripts/test_core.sh runs the core under older releases)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        for value in callspec.params.values() if callspec else ():
            if isinstance(value, str) and value in TINY_FAMILIES and (why := unavailable(value)):
                item.add_marker(pytest.mark.skip(reason=why))
                break


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def no_default_group():
    """No default process group in this process: one an earlier test left (the in-process veRL engine tests keep a
    one-rank gloo group, and tests that need one make it again where none is) is closed first, for a module whose
    tests make their own (``fake_cuda.fake_process_group``)."""
    if dist.is_initialized():
        dist.destroy_process_group()
