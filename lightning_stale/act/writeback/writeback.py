"""WeightWriteBack: own the whole step of an optimizer's bf16/fp16 parameters, with their weights written exactly.

A step's update ``lr * m_hat / (sqrt(v_hat) + eps)`` smaller than half a bf16 weight's grid gap (about |w| / 256)
rounds away. For the parameters it takes over, the write-back computes the optimizer's whole update in fp32 (moments,
weight) right after the closure has made the gradients, in one multi-tensor pass per bucket (:mod:`.families`), and
writes the weight with nearest, stochastic or compensated rounding; it then hides their gradients from the
optimizer's own update, which skips them, and gives them back after it. Compensated summation keeps each weight's
rounding residual in ``optimizer.state[p]["lightning_stale.compensation"]`` (the parameter's dtype and placement: a
DTensor under FSDP2), so every front-end's optimizer checkpoint carries it. fp32 parameters are the optimizer's.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_stale import _compat
from lightning_stale._compat import local_tensor, shard_flat_start
from lightning_stale.act.writeback.family import (
    Columns,
    Family,
    Member,
    Write,
    family_for,
    flat_alias,
    supported,
)
from lightning_stale.act.writeback.kernels import step_key
from lightning_stale.adapters import inner_optimizer
from lightning_stale.messages import info
from lightning_stale.transfers import to_devices
from lightning_stale.vocab import COMPENSATION_KEY, ROUNDINGS, WEIGHT_ROUNDINGS, check_choice

LOW_PRECISION = (torch.bfloat16, torch.float16)


# What compiling one bucket's graphs costs on a CPU from an empty cache (19-34 s measured on 2 cores; a warm cache
# about 5 s): where the run's remaining steps are known, a bucket compiles only if its eager steps would cost more.
COMPILE_SECONDS = 30.0


class _Bucket:
    """Members updated in one pass, with their columns (built when the taken-over set changes); ``judge``: its pass
    would compile on the CPU and the run's remaining steps are known, so its first step runs eagerly and is timed."""

    __slots__ = ("columns", "judge", "members", "params")

    def __init__(self, members: list[Member], columns: Columns, judge: bool = False) -> None:
        self.members, self.columns, self.judge = members, columns, judge
        self.params = [m.param for m in members]


class WeightWriteBack:
    """Owns the step of ``optimizer``'s bf16/fp16 parameters through torch's step pre/post hooks.

    Args:
        optimizer: an optimizer with a write-back family (``supported()``; or a wrapper of one).
        rounding: the weights' rounding: ``"stochastic"`` (no memory), ``"compensated"`` (a residual buffer in the
            parameter's dtype, in the optimizer's state) or ``"nearest"`` (the optimizer's own write; the
            conformance mode).
        params: the parameters to take over (default: every bf16/fp16 parameter of the optimizer).
        seed: the stochastic-rounding key; noise depends on (seed, the write-back's step, the parameter's index).
        moments: the rounding of moments stored in the parameter's dtype (torch.optim's): ``"nearest"`` (as torch's
            fused kernel) or ``"stochastic"``. Optimizers that store their moments in their own format (8-bit
            codes, QuantizedAdamW's formats) round them their way (``"nearest"``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, rounding: str = "stochastic",
                 params: Iterable[Tensor] | None = None, seed: int = 0, moments: str = "nearest") -> None:
        check_choice("rounding", rounding, WEIGHT_ROUNDINGS)
        check_choice("moments", moments, ROUNDINGS)
        self.optimizer: torch.optim.Optimizer = inner_optimizer(optimizer)  # type: ignore[assignment]
        family = family_for(self.optimizer)
        why = "not a supported optimizer family" if family is None else family.refusal()
        if why is None and moments not in family.moment_roundings:  # type: ignore[union-attr]
            why = f"moments={moments!r} applies to optimizers that store their moments in the parameter's dtype"
        if why is not None:
            raise ValueError(f"WeightWriteBack cannot take over {type(self.optimizer).__name__}: {why}. Supported: "
                             f"{supported()}.")
        self.family: Family = family  # type: ignore[assignment]
        self.rounding, self.moments, self.seed = rounding, moments, int(seed)
        self.count = 0  # steps written: with the seed, the noise key of the next one
        self._chosen = None if params is None else {id(p) for p in params}
        if self._chosen is not None and not self._chosen <= {id(p) for p in self._params()}:
            raise ValueError("params must be parameters of the optimizer")
        self._version = 0  # bumped whenever the choice or a checkpoint changes what the plan holds
        self._plan_key: tuple[Any, ...] | None = None
        self._buckets: list[_Bucket] = []
        self._hidden: list[tuple[Tensor, Tensor]] = []  # (parameter, gradient hidden from the optimizer's update)
        self._pending: dict[int, Tensor] = {}  # residuals of a checkpoint that kept them in the callback's state
        self._restored: set[int] = set()  # taken over in a loaded checkpoint: a missing buffer there is said
        self._warned_scaler = False
        self.steps_left: int | None = None  # optimizer steps the run has left, where a front-end knows them
        self._said_eager = False
        # the post-step hook runs first: every other one sees the written weights and the given-back gradients
        self._handles = [
            self.optimizer.register_step_pre_hook(self._pre_hook),
            _compat.register_first_step_post_hook(self.optimizer, self._post_hook),
            _compat.StepErrorHook(self.optimizer, self._give_back),  # a failed step gives the gradients back
        ]

    # ----------------------------------------------------------------------------------------------------------------
    # The choice

    def take_over(self, params: Iterable[Tensor]) -> None:
        """Take over the step of ``params`` too, from the next step on (the automatic remedy's switch)."""
        if self._chosen is not None:
            self._chosen |= {id(p) for p in params}
            self._version += 1

    def plan_steps(self, remaining: int) -> None:
        """The run has ``remaining`` optimizer steps left (a front-end that knows its last step says so): a bucket's
        CPU pass then compiles only where its eager steps over them would cost more than the compile
        (:data:`COMPILE_SECONDS`), judged by timing its first eager step. Without it every large enough bucket
        compiles (a run of unknown length is taken as a long one)."""
        self.steps_left = max(0, int(remaining))
        self._version += 1

    def takes_over(self, param: Tensor) -> bool:
        """Whether the write-back takes over ``param``'s step (once it is stored below fp32)."""
        return self._chosen is None or id(param) in self._chosen

    @property
    def handled(self) -> int:
        """How many parameters the write-back steps now (chosen, stored below fp32, their state initialised)."""
        state = self.optimizer.state
        return sum(1 for group in self.optimizer.param_groups for p in group["params"]
                   if p.dtype in LOW_PRECISION and self.takes_over(p) and self.family.ready(group, state.get(p, {})))

    def describe(self) -> str:
        """How the write-back writes, in words (for messages)."""
        weights = "compensated summation" if self.rounding == "compensated" else f"{self.rounding} rounding"
        if self.family.moment_roundings == ("nearest",):
            return weights
        if self.rounding == self.moments:
            return f"{weights} of the weights and moments"
        return f"{weights} of the weights and {self.moments} rounding of the moments"

    def close(self) -> None:
        """Remove the hooks (giving back gradients a failed step may have left hidden)."""
        self._give_back()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def buffer_bytes(self) -> int:
        """Bytes of the compensation buffers in the optimizer's state (2 per element of a bf16/fp16 parameter)."""
        return sum(local_tensor(s[COMPENSATION_KEY]).numel() * local_tensor(s[COMPENSATION_KEY]).element_size()
                   for s in self.optimizer.state.values() if COMPENSATION_KEY in s)

    def _params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # ----------------------------------------------------------------------------------------------------------------
    # The plan: members and buckets, rebuilt only when something they depend on changes

    def _plan(self) -> list[_Bucket]:
        """The buckets of this step: rebuilt when the choice, a checkpoint, the parameter groups or the optimizer's
        state (a parameter's first step, a loaded state dict) changed since the last build."""
        state = self.optimizer.state
        groups = self.optimizer.param_groups
        key = (self._version, id(state), len(state), len(groups), sum(len(g["params"]) for g in groups))
        if key != self._plan_key:  # a build may create the state of a parameter that had none (its buffer)
            self._buckets = self._build()
            self._plan_key = (self._version, id(state), len(state), len(groups), key[-1])
        return self._buckets

    def _build(self) -> list[_Bucket]:
        """Every bf16/fp16 parameter whose optimizer state exists gets its compensation buffer (compensated rounding:
        the key set of a checkpoint's template is then the same before and after the automatic remedy chooses); the
        chosen ones become members, bucketed by the family."""
        by_key: dict[tuple[Any, ...], list[Member]] = defaultdict(list)
        missing: list[int] = []
        index = 0
        for gindex, group in enumerate(self.optimizer.param_groups):
            for pindex, param in enumerate(group["params"]):
                state = self.optimizer.state.get(param, {})
                if param.dtype in LOW_PRECISION and self.family.ready(group, state):
                    buffer = self._buffer(index, param, state, missing) if self.rounding == "compensated" else None
                    if self.takes_over(param):
                        member = Member(index, param, group, (gindex, pindex), local_tensor(param).detach(),
                                        None if buffer is None else local_tensor(buffer), shard_flat_start(param))
                        by_key[self.family.bucket_key(member)].append(member)
                index += 1
        if missing:
            info(f"[lightning_stale] weight write-back: the checkpoint holds no compensation buffer for "
                 f"{len(missing)} parameter(s) it took over; they continue from a zero residual")
        self._restored -= set(missing)
        buckets = [_Bucket(members, self.family.prepare(members)) for members in by_key.values()]
        for bucket in buckets:
            columns = bucket.columns
            if columns.compiled and self.steps_left is not None and columns.lists["w"][0].device.type == "cpu":
                bucket.judge, columns.compiled = True, False
        return buckets

    def _buffer(self, index: int, param: Tensor, state: dict[str, Any], missing: list[int]) -> Tensor:
        """``param``'s compensation buffer in its optimizer state: created like the parameter (zeros) where absent,
        filled from a checkpoint that kept it in the callback's state, moved to the parameter's device where a
        loaded state left it elsewhere."""
        buffer = state.get(COMPENSATION_KEY)
        saved = self._pending.pop(index, None)
        if buffer is None or buffer.device != param.device or buffer.dtype != param.dtype:
            if buffer is None and saved is None and index in self._restored:
                missing.append(index)
            buffer = torch.zeros_like(param) if buffer is None else buffer.to(param.device, param.dtype)
            self.optimizer.state[param][COMPENSATION_KEY] = buffer
        if saved is not None:
            local_tensor(buffer).copy_(saved)
        return buffer

    # ----------------------------------------------------------------------------------------------------------------
    # Hooks

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Run the write right after the closure (one is given where there is none), after every pre-step hook (the
        monitor's snapshot comes first): torch passes the step's own args, the optimizer first, so the closure is
        args[1] or kwargs["closure"]."""
        self._give_back()  # a step that failed where the error hook could not see it (its wrapper replaced)
        if self.steps_left:
            self.steps_left -= 1
        if not self._plan():
            return None
        if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
            if not self._warned_scaler:  # its gradients are still scaled and its kernel may skip the step
                self._warned_scaler = True
                info("[lightning_stale] weight write-back: a GradScaler hands this optimizer its scale; its own step "
                     "writes the weights while it does")
            return None
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)

        def guarded() -> Any:
            loss = None if closure is None else closure()
            self._write()
            return loss

        if "closure" in kwargs or len(args) < 2:
            return args, {**kwargs, "closure": guarded}
        return (args[0], guarded, *args[2:]), kwargs

    @torch.no_grad()
    def _write(self) -> None:
        """The step of every member with a dense gradient, bucket by bucket, after every bucket's table of this step
        went to its device (one upload per device); their gradients are then hidden from the optimizer's own
        update."""
        key = step_key(self.seed, self.count)
        work = []
        for bucket in self._plan():
            grads = [p.grad for p in bucket.params]
            if all(g is not None and not g.is_sparse for g in grads):
                members, columns, params = bucket.members, bucket.columns, bucket.params
            else:
                take = [i for i, g in enumerate(grads) if g is not None and not g.is_sparse]
                if not take:
                    continue
                members, columns = [bucket.members[i] for i in take], bucket.columns.subset(take)
                params, grads = [bucket.params[i] for i in take], [grads[i] for i in take]
            work.append((members, columns, params, grads, self.family.scalars(members, columns), bucket))
        tables = to_devices([w[4] for w in work], [w[0][0].local.device for w in work])
        for (members, columns, params, grads, _, bucket), table in zip(work, tables):
            local = [local_tensor(g) for g in grads] if columns.sharded else grads
            start = time.perf_counter()
            self.family.update(members, columns, [flat_alias(g) for g in local] if columns.flat else local,
                               Write(self.rounding, self.moments, key, table))
            if bucket.judge:
                self._judge(bucket, time.perf_counter() - start)
            for param in params:
                param.grad = None
            self._hidden.extend(zip(params, grads))
        self.count += bool(work)

    def _judge(self, bucket: _Bucket, seconds: float) -> None:
        """Compile ``bucket``'s CPU pass from its next step on where its eager step (``seconds``, on the host: the CPU
        computes as it is timed) over the run's remaining steps would cost more than compiling; else say once that
        it stays eager."""
        bucket.judge = False
        eager = seconds * (self.steps_left or 0)
        bucket.columns.compiled = eager > COMPILE_SECONDS
        if not bucket.columns.compiled and not self._said_eager:
            self._said_eager = True
            info(f"[lightning_stale] weight write-back: {len(bucket.members)} parameter(s) stay on eager ops: "
                 f"{seconds * 1e3:.0f} ms a step over the run's {self.steps_left} remaining steps costs less than "
                 f"compiling their pass (about {COMPILE_SECONDS:.0f} s from an empty cache)")

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Give the gradients back; notice parameters whose state the optimizer's step just created (their buffers
        exist from then on, so a checkpoint template built by such a step holds them)."""
        self._give_back()
        self._plan()

    def _give_back(self) -> None:
        """Restore the hidden gradients (where no newer one took their place)."""
        for param, grad in self._hidden:
            if param.grad is None:
                param.grad = grad
        self._hidden = []

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints: the buffers travel in the optimizer's state; this is the rest

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs besides the optimizer's state: the roundings, the seed, the steps written and the
        parameters taken over (by index; None: all)."""
        chosen = None if self._chosen is None else [i for i, p in enumerate(self._params()) if id(p) in self._chosen]
        return {"rounding": self.rounding, "moments": self.moments, "seed": self.seed, "count": self.count,
                "params": chosen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`. A checkpoint that kept the compensation buffers here (by parameter index)
        has them moved into the optimizer's state at the next step; a compensated write goes on from a stochastic
        one's checkpoint (zero residuals), not the reverse (it would drop the residuals)."""
        saved = state_dict["rounding"]
        if saved != self.rounding and (saved, self.rounding) != ("stochastic", "compensated"):
            raise ValueError(f"state_dict is for rounding {saved!r}, this is {self.rounding!r}")
        self.seed, self.count = int(state_dict["seed"]), int(state_dict.get("count", 0))
        params = self._params()
        chosen = state_dict.get("params")
        indices = range(len(params)) if chosen is None else [int(i) for i in chosen]
        if self._chosen is not None:  # the parameters it took over go on being taken over
            self._chosen |= {id(params[i]) for i in indices}
        if saved == "compensated":
            self._restored = {i for i in indices if params[i].dtype in LOW_PRECISION}
        self._pending = {int(i): b for i, b in state_dict.get("compensation", {}).items()}
        self._version += 1
