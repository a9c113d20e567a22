"""Every access to another package's private or version-dependent API, each with a fallback (torch's multi-tensor
``torch._foreach_*`` ops aside: torch.optim's own building blocks, used where they are needed).

Keeping them here means a rename upstream breaks one function, and its fallback keeps training runs alive.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, lru_cache
from typing import Any

log = logging.getLogger("lightning_stale")


def global_rank() -> int:
    """This process's rank: torch.distributed when initialized, else the launcher's environment, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def rank_zero_info(message: str) -> None:
    """Lightning's rank-zero info log where Lightning is loaded (its handlers and format), else the same line through
    ``logging``: importing Lightning for a plain loop's first message would add some 40 MiB to the process."""
    if "lightning.fabric" in sys.modules:
        from lightning.fabric.utilities.rank_zero import rank_zero_info as lightning_info

        lightning_info(message)
    elif global_rank() == 0:
        _info_log().info(message)


@cache
def _info_log() -> logging.Logger:
    """The logger of the lines :func:`rank_zero_info` writes without Lightning, set up as Lightning sets up its own:
    INFO and up, to stderr unless the application configured logging."""
    info = logging.getLogger("lightning_stale.info")
    info.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers():
        info.addHandler(logging.StreamHandler())
        info.propagate = False
    return info


def lightning_should_log(trainer: object) -> bool:
    """Whether the Trainer logs on this batch (``log_every_n_steps``), as its logger connector decides."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return bool(connector.should_update_logs)
    every = getattr(trainer, "log_every_n_steps", 50)  # fallback: the rule of Lightning 2.x
    return every > 0 and (lightning_logger_step(trainer) + 1) % every == 0


def lightning_logger_step(trainer: object) -> int:
    """The step Lightning's loggers use for this batch (optimizer steps taken, counted once per batch)."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(epoch_loop, "_batches_that_stepped", None)
    return int(value) if value is not None else int(getattr(trainer, "global_step", 0))


def lightning_accumulating(trainer: object) -> bool:
    """True on a micro-batch after which the Trainer does not step (gradient accumulation); False when unknown."""
    epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    should_accumulate = getattr(epoch_loop, "_should_accumulate", None)
    return bool(should_accumulate()) if callable(should_accumulate) else False


def find_fabric(strategy: object = None) -> object | None:
    """The ``lightning.fabric.Fabric`` on the call stack (the one whose strategy is ``strategy`` when given).

    Fabric passes its callbacks only the strategy and the optimizer, and its callbacks-factory entry points nothing,
    so a callback that logs through ``fabric.log_dict`` finds its Fabric here: as ``self`` of ``Fabric.__init__``
    (entry point) or as a local of the training loop that calls ``optimizer.step()``. None when there is none.
    """
    import inspect

    try:
        from lightning.fabric import Fabric
    except ImportError:  # pragma: no cover - Lightning is a dependency
        return None
    frame = inspect.currentframe()
    while frame is not None:
        for value in frame.f_locals.values():
            if isinstance(value, Fabric) and (strategy is None or getattr(value, "_strategy", None) is strategy):
                return value
        frame = frame.f_back
    return None


def fabric_strategy_stepping(optimizer: Any, callback: object) -> Any | None:
    """The strategy of the Fabric optimizer wrapper (``_FabricOptimizer``) that is stepping ``optimizer`` now, found on
    the call stack, when ``callback`` is one of its callbacks; None otherwise (another Fabric's or no Fabric's
    optimizer, or a Fabric whose wrapper moved: the callback then attaches after the first step)."""
    import inspect

    try:
        from lightning.fabric.wrappers import _FabricOptimizer
    except ImportError:  # pragma: no cover - Lightning is a dependency
        return None
    frame = inspect.currentframe()
    for _ in range(32):  # the wrapper's step is a few frames above torch's pre-step hooks
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        wrapper = frame.f_locals.get("self")
        if isinstance(wrapper, _FabricOptimizer) and getattr(wrapper, "optimizer", None) is optimizer:
            callbacks = getattr(wrapper, "_callbacks", None) or []
            return getattr(wrapper, "_strategy", None) if any(c is callback for c in callbacks) else None
    return None


def fabric_original_module(module: Any) -> Any:
    """The user's module inside Fabric's ``_FabricModule`` wrapper (the one ``fabric.setup`` returns; its parameters
    are named as the user's model names them), else ``module``. Fabric is not imported for it: a wrapper exists only
    where Fabric was."""
    if "lightning.fabric.wrappers" not in sys.modules:
        return module
    from lightning.fabric.wrappers import _FabricModule

    if isinstance(module, _FabricModule):
        inner = getattr(module, "module", None)  # the original module (before strategy wrappers and compile)
        import torch

        return inner if isinstance(inner, torch.nn.Module) else module
    return module


def is_mock_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is the placeholder Lightning uses when ``configure_optimizers`` returns None."""
    try:
        from lightning.pytorch.core.optimizer import _MockOptimizer
    except ImportError:  # pragma: no cover - a moved placeholder: it then counts as an unknown optimizer
        return False
    return isinstance(unwrap_lightning_optimizer(optimizer), _MockOptimizer)


def in_distributed_state_dict() -> bool:
    """Whether the caller runs inside torch's distributed (``torch.distributed.checkpoint``) or FSDP state-dict
    functions, found on the call stack by their modules' names; False where the stack cannot be read."""
    import inspect

    frame = inspect.currentframe()
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(("torch.distributed.checkpoint", "torch.distributed.fsdp")):
            return True
        frame = frame.f_back
    return False


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (an FSDP2 parameter, gradient or optimizer state)."""
    return _DTENSOR is not None and isinstance(tensor, _DTENSOR)


def local_tensor(tensor: Any) -> Any:
    """This process's shard of a ``DTensor`` (FSDP2 parameters, gradients and optimizer states), else the tensor.

    ``to_local()`` is a view of the shard's storage: in-place writes through it change the optimizer's state."""
    if is_dtensor(tensor):
        return tensor.to_local()
    return tensor


def shard_flat_start(tensor: Any) -> int:
    """Flat position, in the whole tensor, of the first element of this process's ``DTensor`` shard (0 for a plain or
    replicated tensor): an FSDP2 dim-0 shard's elements are the whole tensor's from there on. Reads torch's private
    ``compute_local_shape_and_global_offset``; 0 where it is missing or fails."""
    if not is_dtensor(tensor):
        return 0
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    except Exception:  # noqa: BLE001 - a moved private helper: every shard starts its noise at 0
        return 0
    strides = [1] * tensor.dim()
    for d in range(tensor.dim() - 2, -1, -1):
        strides[d] = strides[d + 1] * tensor.shape[d + 1]
    return sum(int(o) * s for o, s in zip(offset, strides))


def register_first_step_post_hook(optimizer: Any, hook: Callable[..., None]) -> Any:
    """``optimizer.register_step_post_hook(hook)``, moved before the post-step hooks registered earlier (the order of
    torch's private ``_optimizer_step_post_hooks``); after them where that dict is gone. Returns the handle."""
    handle = optimizer.register_step_post_hook(hook)
    hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
    if isinstance(hooks, OrderedDict) and handle.id in hooks:
        hooks.move_to_end(handle.id, last=False)
    return handle


class StepErrorHook:
    """Calls ``on_error()`` when ``optimizer.step`` raises, then lets the error propagate (torch runs no hook on an
    error). Installed on the instance as a bound method, as torch's lr schedulers wrap ``step`` (their private
    ``_wrapped_by_lr_sched`` marker is carried over, so a scheduler built earlier does not warn and one built later
    wraps this one); :meth:`remove` restores the previous ``step``, or makes this one a pass-through where another
    wrapper was installed over it since."""

    def __init__(self, optimizer: Any, on_error: Callable[[], None]) -> None:
        import types

        self._optimizer, self._active = optimizer, True
        self._own = optimizer.__dict__.get("step")  # an instance-level wrapper before this one, if any
        previous = optimizer.step
        hook = self

        def step(opt: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return previous(*args, **kwargs)
            except BaseException:
                if hook._active:
                    on_error()
                raise

        if hasattr(previous, "_wrapped_by_lr_sched"):
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self._method = types.MethodType(step, optimizer)
        optimizer.step = self._method

    def remove(self) -> None:
        self._active = False
        if self._optimizer.__dict__.get("step") is self._method:
            if self._own is None:
                del self._optimizer.step
            else:
                self._optimizer.step = self._own


def unwrap_lightning_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper (its private ``_optimizer``; the public
    ``.optimizer`` property where that is gone), else ``optimizer`` itself."""
    import torch

    while True:
        inner = getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) and type(optimizer).__name__ == "LightningOptimizer":
            inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            return optimizer
        optimizer = inner


def torchao_optimizer_classes() -> tuple[type, ...]:
    """torchao's low-bit Adam classes: their private common base ``_AdamBase`` (which covers subclasses users
    write), or the public classes of ``torchao.optim`` if the base moved; empty where ``torchao.optim`` does not
    import on this torch (an error of any kind: torchao releases import on a few torch releases each)."""
    try:
        from torchao.optim.adam import _AdamBase
    except Exception:  # noqa: BLE001 - a moved base, or a torchao that fails on this torch
        try:
            import torchao.optim as ao
        except Exception:  # noqa: BLE001 - no torchao optimizer can exist here
            return ()
        names = ("Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8")
        return tuple(getattr(ao, n) for n in names if isinstance(getattr(ao, n, None), type))
    return (_AdamBase,)


def torchao_state_classes() -> tuple[type, type, type]:
    """torchao's optimizer-state tensor subclasses ``(OptimState8bit, OptimState4bit, OptimStateFp8)``, from its
    internal modules ``torchao.optim.subclass_*``. ImportError, naming the installed torchao and the cause, where
    they moved or fail to import (the torchao adapter is then unavailable, nothing else)."""
    try:
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit
        from torchao.optim.subclass_fp8 import OptimStateFp8
    except Exception as error:  # noqa: BLE001 - any failure inside torchao's modules
        raise ImportError(f"torchao {_version('torchao')}'s optimizer states do not import with torch "
                          f"{_version('torch')} ({type(error).__name__}: {error})") from None
    return OptimState8bit, OptimState4bit, OptimStateFp8


def _version(package: str) -> str:
    """The installed version of ``package``, or "(not installed)"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def inductor_cxx() -> str | None:
    """The C++ compiler Inductor's CPU backend is configured with (``torch._inductor.config.cpp.cxx``), or None."""
    try:
        import torch._inductor.config as inductor_config

        return inductor_config.cpp.cxx[1]
    except (ImportError, AttributeError, IndexError, TypeError):
        return None


@lru_cache(maxsize=1)
def cpu_bf16_units() -> tuple[str, ...]:
    """The CPU's bf16 matrix units that torch's kernels may use (``torch.cpu._is_*_supported``, private), which the
    kernel set's name does not tell apart. Empty where torch cannot tell."""
    import torch

    checks = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    try:
        return tuple(name for name, check in checks if getattr(torch.cpu, check, lambda: False)())
    except Exception:  # noqa: BLE001 - a changed private API: no detail, the kernel set alone
        return ()


@lru_cache(maxsize=1)
def compiler_available() -> bool:
    """Whether a C++ compiler for Inductor's CPU backend is on PATH (torch.compile on CPU needs one)."""
    candidates = [inductor_cxx(), "g++", "c++", "clang++"]
    return any(name and shutil.which(name) for name in candidates)


COMPILE_MIN_NUMEL = 1 << 16  # the package's kernels compile for at least this many elements (a compile costs seconds)


def compiles(numel: int, device: Any) -> bool:
    """Whether a kernel over ``numel`` elements on ``device`` should run ``torch.compile``d: large enough to repay the
    compile, and a compiler for the device (Triton on accelerators, a C++ compiler on CPU; none for ``meta``, which
    holds no data)."""
    kind = getattr(device, "type", device)
    return numel >= COMPILE_MIN_NUMEL and kind != "meta" and (kind != "cpu" or compiler_available())


@contextmanager
def distinct_sizes() -> Iterator[None]:
    """Inside the block, ``torch.compile`` gives every dimension its own size symbol (torch's private
    ``torch.fx.experimental._config.use_duck_shape`` off): by default dynamo gives equal sizes one symbol and guards on
    their equality, so a kernel recompiles (seconds) for every new pattern of equal sizes in a call. Where the setting
    is missing, the block runs under torch's default: more recompiles, the same results."""
    try:
        from torch.fx.experimental import _config as fx_config
    except ImportError:  # pragma: no cover - moved config
        fx_config = None
    if fx_config is None or not hasattr(fx_config, "use_duck_shape"):
        yield
        return
    previous = fx_config.use_duck_shape
    fx_config.use_duck_shape = False
    try:
        yield
    finally:
        fx_config.use_duck_shape = previous


def _vectorized_bitcast(original: Callable[..., Any]) -> Callable[..., Any]:
    """Inductor's CPU vector code for a same-width bit cast (``Tensor.view(dtype)`` of an intermediate) as
    ``at::vec::cast`` per vector (a register reinterpretation) where torch's own goes element by element through
    memory; ``original`` for every other cast."""
    from torch._inductor.codegen.cpp_utils import DTYPE_TO_CPP
    from torch._inductor.virtualized import V

    def to_dtype_bitcast(x: Any, dtype: Any, src_dtype: Any) -> Any:
        try:
            vectors, source_vectors = (V.kernel._get_num_vectors(d) for d in (dtype, src_dtype))
        except AttributeError:  # a codegen without the vector count: torch's own cast
            return original(x, dtype, src_dtype)
        if dtype.itemsize != src_dtype.itemsize or vectors != source_vectors:
            return original(x, dtype, src_dtype)
        target = DTYPE_TO_CPP[dtype]
        if vectors == 1:
            return f"at::vec::cast<{target}>({x})"
        parts = ", ".join(f"at::vec::cast<{target}>({x}[{i}])" for i in range(vectors))
        return f"at::vec::VectorizedN<{target},{vectors}>({parts})"

    return to_dtype_bitcast


class CapturingInductor:
    """``torch.compile``'s Inductor backend that also keeps the graph it compiled last as a direct call: Inductor's
    compiled function and a reader of its inputs from the compiled frame's arguments ``L`` (dynamo names each
    input's source as a Python expression over them, as its own guards read them). Called directly, a graph skips
    dynamo's frame evaluation, guards and size reads, most of a small call's cost; the caller vouches that the
    arguments are what the guards would accept. ``last`` is None where the graph reads anything else (a global)."""

    def __init__(self) -> None:
        self.last: tuple[Callable[..., Any], Callable[[dict[str, Any]], tuple]] | None = None

    def __call__(self, gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs)
        self.last = None
        try:
            names = []
            for node in gm.graph.find_nodes(op="placeholder"):
                name = node.meta["grapharg"].source.name
                names.append(name() if callable(name) else name)
        except (AttributeError, KeyError):  # pragma: no cover - dynamo keeps its sources elsewhere: dynamo's calls
            return compiled
        if all(name.startswith("L[") for name in names):
            self.last = (compiled, eval(f"lambda L: ({''.join(f'{n}, ' for n in names)})", {}))
        return compiled


def _raw_attribute(owner: Any, name: str) -> tuple[Any, bool]:
    """``owner.name`` as stored (a class's raw attribute: a staticmethod stays one), and whether ``owner`` holds it
    itself (a class may inherit it: then restoring means deleting the override)."""
    if not isinstance(owner, type):
        return getattr(owner, name), True
    for klass in owner.__mro__:
        if name in vars(klass):
            return vars(klass)[name], klass is owner
    raise AttributeError(name)


def recompile_limit_name(dynamo_config: Any) -> str | None:
    """The name of dynamo's per-code-object limit of graphs in ``dynamo_config``: ``recompile_limit`` (torch 2.7+),
    ``cache_size_limit`` before; None where neither exists."""
    return next((n for n in ("recompile_limit", "cache_size_limit") if hasattr(dynamo_config, n)), None)


@contextmanager
def multi_tensor_compile(recompile_limit: int = 64) -> Iterator[None]:
    """The settings under which the package's multi-tensor kernels compile and run (entered around their calls): room
    for one graph per group length, dtype and variant (dynamo's ``recompile_limit``, ``cache_size_limit`` before
    torch 2.7), vectorized same-width bit casts on CPU (the stochastic rounding's, otherwise scalar and most of the
    kernel's time), and no size and stride assertions in the generated wrapper (one per tensor on every call; the
    callers check what they would). The kernels' roundings are integer operations on the fp32 bits, which no compiler
    folds away, so no cast emulation is asked for. Private configuration of torch: where one is missing the kernels
    compile and run with the same bits, slower or more often; every setting is restored on leaving, also after an
    error."""
    undo: list[Callable[[], None]] = []

    def set_attribute(owner: Any, name: str, value: Any) -> None:
        try:
            previous, own = _raw_attribute(owner, name)
        except AttributeError:  # not on this torch: left as it is
            return
        setattr(owner, name, value)
        undo.append((lambda: setattr(owner, name, previous)) if own else (lambda: delattr(owner, name)))

    try:
        import torch._dynamo.config as dynamo_config

        limit = recompile_limit_name(dynamo_config)
        if limit is not None:
            set_attribute(dynamo_config, limit, max(recompile_limit, getattr(dynamo_config, limit)))
        try:
            import torch._inductor.config as inductor_config

            set_attribute(inductor_config, "size_asserts", False)
        except ImportError:  # pragma: no cover - torch without Inductor
            pass
        try:
            from torch._inductor.codegen import cpp

            overrides = cpp.CppVecOverrides
            if not getattr(overrides.to_dtype_bitcast, "_lightning_stale", False):
                patched = _vectorized_bitcast(overrides.to_dtype_bitcast)
                patched._lightning_stale = True  # type: ignore[attr-defined]
                set_attribute(overrides, "to_dtype_bitcast", staticmethod(patched))
        except (ImportError, AttributeError):  # pragma: no cover - moved codegen: scalar bit casts, same bits
            pass
        yield
    finally:
        for restore in reversed(undo):
            restore()


def dispatch_mode(handler: Callable[[Any, tuple, dict], Any]) -> Any:
    """A ``TorchDispatchMode`` (torch's private ``torch.utils._python_dispatch``) whose every aten call goes to
    ``handler(func, args, kwargs)``, for the host-sync counter of :mod:`lightning_stale.testing`. Where torch moved
    it, RuntimeError: a counter that cannot see the operations must not report none."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as error:  # pragma: no cover - moved private API
        raise RuntimeError(f"this torch has no TorchDispatchMode to count host syncs with ({error})") from error

    class _Dispatch(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:  # torch.compile'd regions compile and run as they would without it
            return True

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            return handler(func, args, kwargs or {})

    return _Dispatch()


def bnb_dequantize_blockwise(codes: Any, absmax: Any, qmap: Any, block: int) -> Any:
    """bitsandbytes' block-wise 8-bit ``codes`` as fp32 values, with the op its own optimizer step uses
    (``torch.ops.bitsandbytes.dequantize_blockwise``, registered per device)."""
    import torch

    return torch.ops.bitsandbytes.dequantize_blockwise(codes, absmax, qmap, block, torch.float32)


def bnb_quantize_blockwise_into(values: Any, qmap: Any, block: int, codes: Any, absmax: Any) -> None:
    """fp32 ``values`` stored into bitsandbytes' block-wise ``codes`` and their ``absmax`` in place, with the op its
    own optimizer step uses (``torch.ops.bitsandbytes.quantize_blockwise``)."""
    import torch

    new_codes, new_absmax = torch.ops.bitsandbytes.quantize_blockwise(values, qmap, block)
    codes.copy_(new_codes.view(codes.shape))
    absmax.copy_(new_absmax.view(absmax.shape))


def hf_exportable_state() -> type:
    """transformers' ``ExportableState`` (callbacks whose ``state()`` is saved in ``trainer_state.json``), or a plain
    base class on versions without it (their checkpoints then carry no callback state)."""
    try:
        from transformers.trainer_callback import ExportableState
    except ImportError:  # pragma: no cover - transformers < 4.41
        return type("ExportableState", (), {})
    return ExportableState


def unwrap_compiled(module: Any) -> Any:
    """The module inside ``torch.compile``'s wrapper (its ``_orig_mod``), else ``module``."""
    inner = getattr(module, "_orig_mod", None)
    import torch

    return inner if isinstance(inner, torch.nn.Module) else module


@contextmanager
def quiet() -> Iterator[None]:
    """Silence warnings and log records (below ERROR) inside the block: what other packages report while being
    imported or read (torchao's C extensions it cannot load, torch's single-process notices), unrelated to the reader's
    question."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def import_torchao_optim() -> None:
    """Import ``torchao.optim`` quietly (``torch.load(weights_only=True)`` reads its tensor subclasses once it is
    imported); ImportError where torchao is not installed or does not import on this torch."""
    try:
        with quiet():
            import torchao.optim  # noqa: F401
    except ImportError:
        raise
    except Exception as error:  # noqa: BLE001 - a torchao release that fails on this torch
        raise ImportError(f"torchao {_version('torchao')} does not import with torch {_version('torch')} "
                          f"({type(error).__name__}: {error})") from None


def load_distributed_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Every entry of a ``torch.distributed.checkpoint`` folder (as FSDP2 and Lightning's ModelParallelStrategy write
    it), loaded into this process as plain tensors, through torch's private single-process loader (what
    ``_load_state_dict_from_keys`` and ``dcp_to_torch_save`` use). Non-tensor entries must pass
    ``torch.load(weights_only=True)`` first (torch's own loader unpickles them without that restriction). RuntimeError
    where this torch has no such loader."""
    import torch

    try:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError as error:
        raise RuntimeError(f"this torch ({torch.__version__}) cannot read a distributed checkpoint on one process "
                           f"({error})") from None

    class WeightsOnlyPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            torch.load(value, weights_only=True)  # raises for what the weights-only unpickler refuses
            value.seek(0)
            super().load_bytes(read_item, value)

    state: dict[str, Any] = {}
    with quiet():
        _load_state_dict(state, storage_reader=FileSystemReader(os.fspath(path)), planner=WeightsOnlyPlanner(),
                         no_dist=True)
    return state


def hf_parameter_orders(folder: str | os.PathLike) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The trainable parameters of the Hugging Face model saved in ``folder`` as ``(name, shape)``, in the orders an
    optimizer may hold them: the Trainer's default grouping (weight-decayed parameters, then the others, each in module
    order), then module order. The model is built from ``config.json`` on the meta device (no weights read) with
    ``Trainer.get_decay_parameter_names``, a method called here without a Trainer; without it only module order. Empty
    where transformers cannot build the model (not installed, a remote-code architecture, no config)."""
    try:
        import torch
        import transformers

        with quiet():
            config = transformers.AutoConfig.from_pretrained(os.fspath(folder))
            model_class = getattr(transformers, (config.architectures or [""])[0], None)
            if model_class is None:
                return []
            with torch.device("meta"):
                model = model_class(config)
    except Exception:  # noqa: BLE001 - any failure to build the skeleton only means no names
        return []
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    try:
        decayed = set(transformers.Trainer.get_decay_parameter_names(None, model))
    except Exception:  # noqa: BLE001 - the method changed: module order only
        return [named]
    grouped = [entry for entry in named if entry[0] in decayed] + [entry for entry in named if entry[0] not in decayed]
    return [grouped, named]
