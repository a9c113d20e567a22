"""Adapter lookup: entry points of installed packages (both documented forms) and later registrations."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import lightning_stale.adapters as adapters
from lightning_stale.adapters import ENTRY_POINT_GROUP, adapter_for

PLUGIN = textwrap.dedent('''
    import torch
    from lightning_stale.adapters import register_adapter
    from lightning_stale.adapters.generic import GenericAdapter

    class CallableOpt(torch.optim.SGD):
        pass

    class PairOpt(torch.optim.SGD):
        pass

    class CallableAdapter(GenericAdapter):
        family = "plugin-callable"

    class PairAdapter(GenericAdapter):
        family = "plugin-pair"

    def register():
        register_adapter(CallableOpt, CallableAdapter)

    PAIR = (PairOpt, PairAdapter)
''')


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A package installed on sys.path with two entry points in the adapter group, loaded afresh."""
    (tmp_path / "stale_plugin.py").write_text(PLUGIN)
    dist = tmp_path / "stale_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: stale-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\ncallable = stale_plugin:register\npair = stale_plugin:PAIR\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(adapters, "_LOADED", set(adapters._LOADED) - {ENTRY_POINT_GROUP})
    monkeypatch.setattr(adapters, "_REGISTRY", dict(adapters._REGISTRY))
    yield
    sys.modules.pop("stale_plugin", None)


def test_entry_points_register_adapters_in_both_forms(installed_plugin) -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    import stale_plugin

    assert adapter_for(stale_plugin.CallableOpt(params, lr=0.1)).family == "plugin-callable"
    assert adapter_for(stale_plugin.PairOpt(params, lr=0.1)).family == "plugin-pair"
    assert adapter_for(torch.optim.SGD(params, lr=0.1)).family == "torch.optim"


def test_builtin_library_adapters_register_once_imported() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert adapter_for(bnb.optim.Adam8bit(params)).family == "bitsandbytes"
