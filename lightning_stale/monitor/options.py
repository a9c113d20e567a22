"""MonitorOptions: every option the front-ends share, validated once where they are given.

Frozen, so one object can configure several monitors (the Fabric front-end attaches one per optimizer). The reset
policy and the remedy are built here from their shortcut names and the arguments that configure them (``every``,
``s0``, ``min_interval``, ``moments``, ``drift_band``, and a registered third-party shortcut's in ``policy_args``; see
:mod:`lightning_stale.decide.registry`); an argument that nothing chosen uses is an error, not ignored, and a policy or
remedy *object* carries its own arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from lightning_stale.decide import policies
from lightning_stale.decide import registry
from lightning_stale.decide import remedies
from lightning_stale.decide.policies import ResetPolicy
from lightning_stale.decide.remedies import Remedy
from lightning_stale.monitor import metrics
from lightning_stale.vocab import WEIGHT_WRITES, check_choice, check_flag, check_int, invalid

TRACK_MODES = ("sample", "exact")
V_RESETS = ("bounded", "exact-unbounded")
POLICY_ARGUMENTS = ("every", "s0", "min_interval", "moments", "drift_band")  # the built-in shortcuts' arguments


@dataclass(frozen=True)
class MonitorOptions:
    """The options of :class:`~lightning_stale.monitor.StaleStateMonitor` and its front-ends. ``None`` for a policy
    argument means the policy's own default; ``policy`` and ``remedy_rule`` are the objects built from ``reset`` and
    ``remedy``.

    Attributes:
        reset: ``None`` (monitor only), ``"periodic"`` (needs ``every``), ``"theory"`` (period K* from the paper's
            model for each slot's format and beta), ``"adaptive"`` (paper Alg. 2 on the measured stall fraction),
            ``"drift"`` (when stored v leaves ``drift_band`` around its fp32 EMA) or any
            :class:`~lightning_stale.decide.policies.ResetPolicy` (which carries its own arguments).
        every: reset period in optimizer steps for ``reset="periodic"``.
        s0: staleness tolerance of the theory and adaptive rules (default 0.6, the paper's).
        min_interval: fewest steps between two adaptive or drift resets of a parameter (default 50).
        moments: which moments a shortcut policy or the remedy resets: ``("m", "v")`` (default) or ``("v",)``.
        track: ``"sample"`` measures a systematic sample of up to ``sample_size`` elements of each slot of
            ``params_per_step`` parameters per measured step, in turn; ``"exact"`` compares every element of every
            slot on every measured step.
        sample_size: elements per slot in sample mode.
        params_per_step: parameters measured per step in sample mode (raised so that every parameter is measured
            within the monitor's ``coverage_steps`` measured steps).
        track_every: measure one optimizer step in ``track_every`` (drift shadows still see every step).
        log_per_param: ``compute()`` also returns ``<prefix>/<param name>/<state key>/frac`` for every parameter
            measured in the window.
        log_key_prefix: prefix of every key.
        strict: raise for optimizers without an adapter; ``False`` falls back to a generic adapter with a warning.
        seed: seed of the element sample (ranks may use different seeds: counts are summed across ranks).
        underflow_guard: after every real step, zero the first moment of elements whose stored second moment is
            exactly zero while m is not (see :mod:`lightning_stale.act.guard`). Whatever this says, the parameters a
            reset touched are guarded for the next ``POST_RESET_GUARD_STEPS`` steps.
        warmup_steps: after a reset, scale the next ``warmup_steps`` updates of the reset parameters by
            ``i / warmup_steps`` (SPAM-style).
        v_reset: how a v-only reset (``moments=("v",)``) restarts v. ``"bounded"`` (default) keeps m and writes v so
            that the next update is at most about lr (see :mod:`lightning_stale.adapters.restart`).
            ``"exact-unbounded"`` is the paper's exact asymmetric reset on optimizers with one age per moment
            (``QuantizedAdamW``): v and its age restart from zero while m is kept, so the next update is
            ``lr * m_hat / |g|`` per element, unbounded where the new gradient is small. Other optimizers always use
            the bounded restart.
        remedy: ``"auto"`` or a :class:`~lightning_stale.decide.remedies.Remedy`: per parameter, the remedy its measured
            cause calls for (see :mod:`lightning_stale.decide.remedies`), logged as ``<prefix>/remedy/...``. It chooses
            resets itself, so it cannot be combined with ``reset``.
        weights: the step of parameters stored below fp32 (bf16, fp16), taken over by the weight write-back (see
            :mod:`lightning_stale.act.writeback`; torch.optim Adam/AdamW/SGD, bitsandbytes Adam/AdamW/Lion,
            ``QuantizedAdamW``) so that updates smaller than half the weight's grid gap are not rounded away: it
            computes the step in fp32 and writes the weight with ``"stochastic"`` rounding (no memory) or
            ``"compensated"`` summation (a residual buffer in the parameter's dtype, 2 bytes per element, in the
            optimizer's state, so every checkpoint carries it); ``"<rounding>+moments"`` also rounds the moments it
            writes in the parameter's dtype (torch.optim's) stochastically instead of to nearest; ``"off"`` (never),
            or ``None`` (default: off, unless ``remedy="auto"`` takes over the weights that stall, with compensated
            summation and stochastic rounding of torch.optim's moments).
        drift_band: allowed ratio of stored v to its fp32 EMA for ``reset="drift"`` and ``remedy="auto"`` (default
            1.5).
        policy_args: arguments of a shortcut registered outside the package (with
            :func:`~lightning_stale.decide.registry.register_policy` or ``register_remedy``) by name, e.g.
            ``reset="mine", policy_args={"patience": 3}``; the built-in arguments above are passed as themselves.
    """

    reset: str | ResetPolicy | None = None
    every: int | None = None
    s0: float | None = None
    min_interval: int | None = None
    moments: Sequence[str] | None = None
    track: str = "sample"
    sample_size: int = 512
    params_per_step: int = 4
    track_every: int = 1
    log_per_param: bool = False
    log_key_prefix: str = metrics.DEFAULT_PREFIX
    strict: bool = True
    seed: int = 0
    underflow_guard: bool = False
    warmup_steps: int = 0
    v_reset: str = "bounded"
    remedy: str | Remedy | None = None
    drift_band: float | None = None
    weights: str | None = None
    policy_args: Mapping[str, Any] | None = None
    policy: ResetPolicy | None = field(init=False, repr=False, compare=False)
    remedy_rule: Remedy | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_choice("track", self.track, TRACK_MODES)
        for name in ("sample_size", "params_per_step", "track_every"):
            check_int(name, getattr(self, name))
        if not isinstance(self.log_key_prefix, str) or not self.log_key_prefix:
            raise invalid("log_key_prefix", "a non-empty string", self.log_key_prefix)
        for name in ("log_per_param", "strict", "underflow_guard"):
            check_flag(name, getattr(self, name))
        check_int("warmup_steps", self.warmup_steps, minimum=0, unit="0 disables the post-reset warm-up")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise invalid("seed", "an int", self.seed)
        check_choice("v_reset", self.v_reset, V_RESETS)
        check_choice("weights", self.weights, (None, *WEIGHT_WRITES))
        given = {name: getattr(self, name) for name in POLICY_ARGUMENTS if getattr(self, name) is not None}
        given.update(_registered_arguments(self.policy_args))
        checks = registry.validators()
        for name, value in given.items():  # a bad value fails here, even where it would go unused
            if checks.get(name) is not None:
                given[name] = checks[name](value)
        remedy, used_by_remedy = remedies.make_remedy(self.remedy, given)
        if self.remedy is not None and self.reset is not None:
            raise ValueError(f"remedy={self.remedy!r} chooses the resets itself (by drift); drop `reset` "
                             f"(got reset={self.reset!r}) or set remedy=None")
        policy, used_by_policy = policies.make_policy(self.reset, given)
        for name in given:
            if name not in used_by_policy | used_by_remedy:
                raise _unused(name, self.reset, self.remedy)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "remedy_rule", remedy)

    @classmethod
    def from_arguments(cls, owner: str, arguments: dict[str, Any]) -> MonitorOptions:
        """Options from a front-end's keyword arguments; an unknown keyword is reported as ``owner``'s."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(arguments) - known)
        if unknown:
            raise TypeError(f"{owner} got an unexpected keyword argument {unknown[0]!r}; its options are "
                            + ", ".join(f.name for f in fields(cls) if f.init))
        return cls(**arguments)


def _unused(name: str, reset: object, remedy: object) -> ValueError:
    """The error for a policy argument that neither the chosen policy nor the remedy takes."""
    for chosen in (reset, remedy):
        if isinstance(chosen, (ResetPolicy, Remedy)):
            return ValueError(f"`{name}` configures the reset and remedy shortcuts, not {type(chosen).__name__}: "
                              f"pass it to the object's constructor instead")
    users = registry.users(name)
    return ValueError(f"`{name}` is only used with {' or '.join(users)}; pass one of them or drop `{name}`")


def _registered_arguments(policy_args: object) -> dict[str, Any]:
    """``policy_args`` checked: a mapping of arguments that registered shortcuts take and that are not options."""
    if policy_args is None:
        return {}
    if not isinstance(policy_args, Mapping):
        raise invalid("policy_args", "None or a mapping of argument names to values", policy_args)
    known = registry.validators()
    for name in policy_args:
        if name in POLICY_ARGUMENTS:
            raise ValueError(f"pass `{name}` as its own option, not in `policy_args`")
        if name not in known:
            others = sorted(set(known) - set(POLICY_ARGUMENTS)) or "none"
            raise ValueError(f"`policy_args` names {name!r}, which no registered reset or remedy takes (theirs: "
                             f"{others})")
    return dict(policy_args)
