"""Every private API we reach lives in ``lightning_stale._compat``: each access is checked against the installed
packages (so an upstream rename fails here, in CI, not inside a training run) and its fallback is checked too."""

from __future__ import annotations

import logging
import types

import lightning as L
import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from helpers import twin_guarded
from lightning_stale import _compat


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", **kwargs)


def test_the_private_lightning_attributes_still_exist():
    trainer = _trainer(log_every_n_steps=5)
    assert isinstance(trainer._logger_connector.should_update_logs, bool)
    assert isinstance(trainer.fit_loop.epoch_loop._batches_that_stepped, int)
    assert callable(trainer.fit_loop.epoch_loop._should_accumulate)
    assert _compat.lightning_logger_step(trainer) == 0


def test_lightning_fallbacks_follow_the_public_rule():
    stand_in = types.SimpleNamespace(log_every_n_steps=5, global_step=9)  # none of the private attributes
    assert _compat.lightning_logger_step(stand_in) == 9
    assert _compat.lightning_should_log(stand_in)  # (9 + 1) % 5 == 0, Lightning 2.x's rule
    stand_in.global_step = 10
    assert not _compat.lightning_should_log(stand_in)
    assert not _compat.lightning_accumulating(stand_in)  # unknown: treated as a stepping batch


def test_unwrap_lightning_optimizer():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert _compat.unwrap_lightning_optimizer(LightningOptimizer(opt)) is opt
    assert _compat.unwrap_lightning_optimizer(opt) is opt


def test_inductor_cxx_and_its_fallback():
    import torch._inductor.config as inductor_config

    assert _compat.inductor_cxx() == inductor_config.cpp.cxx[1]  # the setting as torch spells it today
    with inductor_config.patch({"cpp.cxx": ()}):  # an unexpected shape of the setting: no compiler name, no error
        assert _compat.inductor_cxx() is None


def test_torchao_classes_and_their_fallback(monkeypatch):
    adam = pytest.importorskip("torchao.optim.adam")
    import torchao.optim as ao

    assert _compat.torchao_optimizer_classes() == (adam._AdamBase,)
    monkeypatch.delattr(adam, "_AdamBase")
    fallback = _compat.torchao_optimizer_classes()
    assert ao.AdamW8bit in fallback and ao.AdamWFp8 in fallback and ao.AdamW4bit in fallback


def test_distinct_sizes_turns_duck_shaping_off_inside_and_back_after():
    import torch.fx.experimental._config as fx_config

    before = fx_config.use_duck_shape
    with pytest.raises(RuntimeError, match="inside"), _compat.distinct_sizes():
        assert fx_config.use_duck_shape is False
        raise RuntimeError("inside")
    assert fx_config.use_duck_shape == before


def test_without_the_duck_shape_setting_the_guard_runs_under_torchs_default(monkeypatch):
    """A torch without ``use_duck_shape`` (2.4's config has none): the guard's pass compiles and runs under the default
    duck shaping and writes the same bits as the exact masks; no error, no fallback to eager ops."""
    import torch.fx.experimental as fx_experimental

    import lightning_stale.act.guard as guard

    real = fx_experimental._config

    class WithoutDuckShape(types.ModuleType):  # the config as torch's own modules read it, less the setting
        def __getattr__(self, name):
            if name == "use_duck_shape":
                raise AttributeError(name)
            return getattr(real, name)

    monkeypatch.setattr(fx_experimental, "_config", WithoutDuckShape(real.__name__))
    monkeypatch.setattr(guard, "_fused_failed", False)
    with _compat.distinct_sizes():
        pass
    assert all(torch.equal(a, b) for a, b in zip(twin_guarded("bnb", count=True), twin_guarded("bnb", count=False)))
    assert not guard._fused_failed


def _hide_torchao_optim(monkeypatch, error: Exception) -> None:
    """Make ``import torchao.optim`` (and its modules) raise ``error``, as a torchao release that does not import on
    this torch does (torchao 0.17 on torch 2.6: AttributeError from ``torch.utils._pytree``)."""
    import importlib.abc
    import sys

    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torchao.optim" or name.startswith("torchao.optim."):
                raise error
            return None

    for name in [n for n in sys.modules if n == "torchao.optim" or n.startswith("torchao.optim.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])


def test_a_torchao_that_fails_to_import_is_torchao_not_installed(monkeypatch):
    """Any error from importing torchao's optimizers reads as torchao missing: no torchao classes, an ImportError naming
    the versions for the checkpoint reader (which turns it into its message)."""
    pytest.importorskip("torchao.optim")
    error = AttributeError("module 'torch.utils._pytree' has no attribute 'register_constant'")
    _hide_torchao_optim(monkeypatch, error)
    assert _compat.torchao_optimizer_classes() == ()
    with pytest.raises(ImportError, match=r"torchao .* does not import with torch .*register_constant"):
        _compat.import_torchao_optim()
    with pytest.raises(ImportError, match=r"optimizer states do not import with torch"):
        _compat.torchao_state_classes()


def test_torchao_state_classes_are_its_subclasses():
    pytest.importorskip("torchao.optim")
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    assert _compat.torchao_state_classes() == (OptimState8bit, OptimState4bit, OptimStateFp8)


def test_a_broken_torchao_adapter_leaves_every_other_optimizer_its_adapter(monkeypatch):
    """torchao's internal modules moved (the torchao adapter cannot load): one warning names torchao and the cause, and
    the lookup goes on for torch's optimizers; a torchao optimizer then has no adapter (a clear TypeError)."""
    import sys

    ao = pytest.importorskip("torchao.optim")
    import lightning_stale.adapters as adapters

    monkeypatch.setattr(adapters, "_REGISTRY", {})
    monkeypatch.setattr(adapters, "_LOADED", set())
    monkeypatch.delitem(sys.modules, "lightning_stale.adapters.torchao", raising=False)
    monkeypatch.setitem(sys.modules, "torchao.optim.subclass_fp8", None)  # import of it raises ImportError
    param = torch.nn.Parameter(torch.zeros(4))
    with pytest.warns(UserWarning, match=r"cannot read torchao.optim optimizers .*ImportError.*unaffected"):
        adapter = adapters.adapter_for(torch.optim.AdamW([param], lr=0.1))
    assert adapter.family == "torch.optim"
    with pytest.raises(TypeError, match="no lightning_stale adapter for optimizer torchao"):
        adapters.adapter_for(ao.AdamW8bit([param], lr=0.1))


def test_torchao_classes_when_its_modules_raise_another_error(monkeypatch):
    """``torchao.optim.adam`` raising something else than ImportError on lookup: the public classes, found by name."""
    import sys

    ao = pytest.importorskip("torchao.optim")

    class Moved(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError(f"{name} moved")

    monkeypatch.setitem(sys.modules, "torchao.optim.adam", Moved("torchao.optim.adam"))
    assert ao.AdamW8bit in _compat.torchao_optimizer_classes()


def test_hf_exportable_state_and_its_fallback(monkeypatch):
    """transformers' ``ExportableState`` where it exists (4.41+), else a plain base class: the Hugging Face callback
    still builds, and its state is then not saved in ``trainer_state.json``."""
    trainer_callback = pytest.importorskip("transformers.trainer_callback")
    assert _compat.hf_exportable_state() is trainer_callback.ExportableState
    monkeypatch.delattr(trainer_callback, "ExportableState")
    fallback = _compat.hf_exportable_state()
    assert isinstance(fallback, type) and fallback.__name__ == "ExportableState" and not hasattr(fallback, "state")


def test_a_torch_without_the_single_process_checkpoint_loader_says_so(monkeypatch, tmp_path):
    from torch.distributed.checkpoint import state_dict_loader

    from lightning_stale.adapters.saved_state import SavedStateError, load_checkpoint

    monkeypatch.delattr(state_dict_loader, "_load_state_dict")
    with pytest.raises(RuntimeError, match=r"this torch \(.*\) cannot read a distributed checkpoint on one process"):
        _compat.load_distributed_checkpoint(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"")  # what makes the folder a distributed checkpoint
    with pytest.raises(SavedStateError, match="cannot read a distributed checkpoint on one process"):
        load_checkpoint(tmp_path)


def test_shard_start_without_torchs_offset_helper_is_zero(monkeypatch):
    from torch.distributed.tensor import _utils

    monkeypatch.setattr(_compat, "is_dtensor", lambda tensor: True)  # a stand-in shard; the helper is gone
    monkeypatch.delattr(_utils, "compute_local_shape_and_global_offset")
    assert _compat.shard_flat_start(torch.zeros(4, 3)) == 0


def test_the_first_post_hook_without_torchs_ordered_hooks_still_runs():
    """Where torch keeps its post-step hooks in something else than an OrderedDict, the hook is added last (the
    public order) instead of first, and runs."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    order = []
    opt.register_step_post_hook(lambda *args: order.append("earlier"))
    _compat.register_first_step_post_hook(opt, lambda *args: order.append("ours"))
    opt.step()
    assert order == ["ours", "earlier"]
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    class Hooks(dict):  # another mapping than OrderedDict (weak-referenceable, as torch's handles need)
        pass

    plain._optimizer_step_post_hooks = Hooks(plain._optimizer_step_post_hooks)
    order.clear()
    plain.register_step_post_hook(lambda *args: order.append("earlier"))
    _compat.register_first_step_post_hook(plain, lambda *args: order.append("ours"))
    plain.step()
    assert order == ["earlier", "ours"]


def test_cpu_bf16_units_when_torchs_checks_fail(monkeypatch):
    _compat.cpu_bf16_units.cache_clear()

    def broken():
        raise RuntimeError("changed")

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", broken, raising=False)
    try:
        assert _compat.cpu_bf16_units() == ()
    finally:
        _compat.cpu_bf16_units.cache_clear()


def test_unwrap_lightning_optimizer_through_its_public_property():
    """A Lightning release that keeps the wrapped optimizer under another private name: its ``optimizer`` property."""
    class LightningOptimizer:  # noqa: N801 - Lightning's wrapper, as the fallback recognizes it
        def __init__(self, optimizer):
            self._wrapped = optimizer

        @property
        def optimizer(self):
            return self._wrapped

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert _compat.unwrap_lightning_optimizer(LightningOptimizer(opt)) is opt


def test_fabric_lookups_without_fabrics_private_wrapper(monkeypatch):
    """Without ``_FabricOptimizer`` no stepping strategy is found (the callback attaches after the first step)."""
    from lightning.fabric import wrappers

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    monkeypatch.delattr(wrappers, "_FabricOptimizer")
    assert _compat.fabric_strategy_stepping(opt, object()) is None


def test_hf_parameter_orders_without_the_trainers_grouping(monkeypatch, tmp_path):
    """Without ``Trainer.get_decay_parameter_names`` only module order is offered; without a config, nothing."""
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8,
                            architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    grouped, module_order = _compat.hf_parameter_orders(tmp_path)
    assert sorted(grouped) == sorted(module_order) and grouped != module_order
    monkeypatch.delattr(transformers.Trainer, "get_decay_parameter_names")
    assert _compat.hf_parameter_orders(tmp_path) == [module_order]
    assert _compat.hf_parameter_orders(tmp_path / "missing") == []


def test_dtensor_type_where_torch_has_none(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", None)
    assert _compat._dtensor_type() is None
    monkeypatch.setattr(_compat, "_DTENSOR", None)
    assert not _compat.is_dtensor(torch.zeros(2)) and _compat.local_tensor(torch.zeros(2)).shape == (2,)


def test_the_floors_file_is_pyprojects_lower_bounds():
    """``tests/floors.txt`` (the constraints that install every dependency at its oldest supported release) pins each
    package at exactly the lower bound pyproject.toml declares, and names every package with one."""
    import re
    from pathlib import Path

    from packaging.version import Version

    root = Path(__file__).resolve().parent.parent
    pins = dict(re.findall(r"^([\w-]+)==(\S+)$", (root / "tests" / "floors.txt").read_text(), re.M))
    floors = dict(re.findall(r'"([\w-]+)(?:\[\w+\])?>=([\d.]+)"', (root / "pyproject.toml").read_text()))
    floors.pop("setuptools")  # the build backend's, not a dependency
    floors.pop("requests")  # any release the tests' HTTP stand-ins run on
    assert {name: Version(v) for name, v in pins.items()} == {name: Version(v) for name, v in floors.items()}


@pytest.mark.parametrize("version", ["3.2.0", "3.3.1+git5a3c7"])
def test_an_older_triton_leaves_the_cuda_write_back_to_the_eager_ops(version, caplog):
    """Triton before 3.4 (torch 2.6 and 2.7 pin 3.2 and 3.3) cannot run the write-back's kernels: the CUDA pass
    declines before touching anything, says so once, and the caller's eager ops write the same bits."""
    from lightning_stale.act.writeback import triton_pass

    kernels = types.SimpleNamespace(triton=types.SimpleNamespace(__version__=version))
    step = triton_pass.TritonPass("adam", device_type="cpu", kernels=kernels)
    columns = [[torch.ones(5, dtype=torch.bfloat16)], [None], [torch.ones(5)]] + [
        [torch.zeros(5, dtype=torch.bfloat16)] for _ in range(2)]
    before = [[None if t is None else t.clone() for t in column] for column in columns]
    rows = [torch.zeros(1, 8), torch.zeros(1, 2, dtype=torch.int32)]
    with caplog.at_level(logging.INFO, logger="lightning_stale"):
        assert not step(columns, rows, ("nearest", "nearest", True), True, {})
        assert not step(columns, rows, ("nearest", "nearest", True), True, {})
    assert all(a is b or torch.equal(a, b) for x, y in zip(columns, before) for a, b in zip(x, y))
    said = [r.getMessage() for r in caplog.records if "Triton kernel does not take" in r.getMessage()]
    assert len(said) == 1 and f"Triton {version} is older than 3.4" in said[0], said
