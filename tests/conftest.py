"""Fixtures, and one intra-op thread per test process: the device every device-parametrized test runs on (``cpu``
always, ``cuda`` when present), a fresh bitsandbytes override registry per test, and the host-sync counter entered
for the whole test (``host_syncs``). The helpers the test files share
live in ``helpers.py``.

The tests' tensors are small, and on a machine whose cores are busy with something else, intra-op threads that wait on
each other slow a process far more than the work they share (a 316-tensor GPT-2 step: about 9 s with torch's default
two threads and one core taken). ``OMP_NUM_THREADS`` also reaches every subprocess a test starts (the multi-process
workers and the ranks Lightning launches for them, which keep it); a test that needs more threads sets them itself and
says why.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported: read when its thread pool starts

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def fresh_bitsandbytes_overrides():
    """bitsandbytes keeps per-parameter overrides in a process-wide singleton keyed by (group, position): the
    Hugging Face Trainer registers 32-bit embeddings there, which would silently give the first parameter of every
    later bitsandbytes optimizer fp32 states. Each test starts and ends with no overrides."""
    try:
        from bitsandbytes.optim import GlobalOptimManager
    except ImportError:  # pragma: no cover - bitsandbytes is a dependency
        yield
        return
    GlobalOptimManager.get_instance().initialize()
    yield
    GlobalOptimManager.get_instance().initialize()


@pytest.fixture
def host_syncs():
    """A :class:`~lightning_stale.testing.HostSyncCounter` entered for the whole test (it must see the optimizer's
    first step): the test marks its logging steps and checks ``offenders`` afterwards."""
    from lightning_stale.testing import HostSyncCounter

    with HostSyncCounter() as counter:
        yield counter
