"""Option validation in one place: every front-end's options are validated once, by ``MonitorOptions``, where they
are given (the Trainer callback, the monitor, Fabric), with one message style naming the argument."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_stale import StaleStateCallback, StaleStateMonitor
from lightning_stale.policies import AdaptiveReset, PeriodicReset, TheoryReset


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reset": "sometimes"}, "`reset` must be"),
        ({"reset": "periodic"}, "needs `every`"),
        ({"every": 5}, "`every` is only used"),
        ({"reset": "theory", "every": 5}, "`every` is only used"),
        ({"reset": "periodic", "every": 0}, "`every` must be a positive int"),
        ({"track": "all"}, r"`track` must be one of \('sample', 'exact'\)"),
        ({"sample_size": 0}, "`sample_size` must be a positive int"),
        ({"track_every": -1}, "`track_every` must be a positive int"),
        ({"moments": ("x",)}, "`moments` must be"),
        ({"moments": "v"}, "`moments` must be"),
        ({"reset": "theory", "s0": 1.5}, "`s0` must be"),
        ({"reset": "adaptive", "min_interval": 0}, "`min_interval` must be"),
        ({"log_key_prefix": ""}, "`log_key_prefix` must be"),
        ({"s0": 2.0}, "`s0` must be"),  # validated although the default policy (none) does not use it
        ({"reset": "periodic", "every": 5, "min_interval": 0}, "`min_interval` must be"),
        ({"v_reset": "paper"}, "`v_reset` must be one of"),
        ({"params_per_step": 0}, "`params_per_step` must be a positive int"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StaleStateCallback(**kwargs)


def test_policy_constructors_validate():
    with pytest.raises(ValueError, match="`every`"):
        PeriodicReset(2.5)
    with pytest.raises(ValueError, match="`s0`"):
        TheoryReset(s0=0)
    with pytest.raises(ValueError, match="`moments`"):
        AdaptiveReset(moments=())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reset": 5}, "`reset` must be None, one of"),
        ({"reset": PeriodicReset}, "`reset` must be None, one of"),
        ({"reset": "periodic", "every": 2.5}, "`every` must be a positive int"),
        ({"reset": "periodic", "every": True}, "`every` must be a positive int"),
        ({"reset": "adaptive", "s0": "0.6"}, "`s0` must be a float in"),
        ({"reset": "adaptive", "s0": float("nan")}, "`s0` must be a float in"),
        ({"reset": "theory", "s0": 0.0}, "`s0` must be a float in"),
        ({"reset": "adaptive", "min_interval": 2.5}, "`min_interval` must be a positive int"),
        ({"moments": ()}, "`moments` must be a non-empty tuple"),
        ({"moments": ("m", "w")}, "`moments` must be a non-empty tuple"),
        ({"track": None}, r"`track` must be one of \('sample', 'exact'\)"),
        ({"sample_size": True}, "`sample_size` must be a positive int"),
        ({"sample_size": 10.0}, "`sample_size` must be a positive int"),
        ({"track_every": 0}, "`track_every` must be a positive int"),
        ({"log_key_prefix": None}, "`log_key_prefix` must be a non-empty string"),
        ({"log_per_param": "yes"}, "`log_per_param` must be True or False"),
        ({"strict": "no"}, "`strict` must be True or False"),
        ({"seed": 1.5}, "`seed` must be an int"),
        ({"seed": "0"}, "`seed` must be an int"),
    ],
)
def test_more_invalid_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StaleStateCallback(**kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"params_per_step": 0}, "`params_per_step` must be a positive int"),
    ({"coverage_steps": 0}, "`coverage_steps` must be a positive int"),
    ({"track": "most"}, r"`track` must be one of \('sample', 'exact'\)"),
])
def test_invalid_monitor_options_fail_at_construction(kwargs, match):
    opt = torch.optim.AdamW(nn.Linear(4, 4).parameters())
    with pytest.raises(ValueError, match=match):
        StaleStateMonitor(opt, **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"remedy": "yes"}, r"`remedy` must be one of \(None, 'auto'\)"),
    ({"remedy": "auto", "reset": "theory"}, "remedy='auto' chooses the resets itself"),
    ({"drift_band": 1.0}, "`drift_band` must be a finite float > 1"),
    ({"drift_band": True}, "`drift_band` must be a finite float > 1"),
    ({"reset": "drift", "drift_band": math.inf}, "`drift_band` must be a finite float > 1"),
])
def test_invalid_remedy_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StaleStateCallback(**kwargs)
    opt = torch.optim.AdamW(nn.Linear(4, 4).parameters())
    with pytest.raises(ValueError, match=match):
        StaleStateMonitor(opt, **kwargs)


def test_an_unknown_option_is_reported_as_the_callers():
    opt = torch.optim.AdamW(nn.Linear(4, 4).parameters())
    with pytest.raises(TypeError, match="StaleStateMonitor got an unexpected keyword argument 'resets'"):
        StaleStateMonitor(opt, resets="theory")
    from lightning_stale.fabric import StaleStateFabricCallback

    with pytest.raises(TypeError, match="StaleStateFabricCallback got an unexpected keyword argument 'trak'"):
        StaleStateFabricCallback(trak="exact")
