"""Counter-based noise for stochastic rounding: one 32-bit integer hash of each element's index and a key.

No RNG state is read or advanced: the same (key, index) gives the same bits on every rank and device, eager or
``torch.compile``d, so replicated processes round alike and a parameter written in pieces draws what it would draw
whole. Every stochastic rounding in the package (``QuantizedAdamW``'s moments, the weight write-back, the demo's
controls) draws from :func:`counter_hash`.
"""

from __future__ import annotations

import torch
from torch import Tensor

NOISE_BITS = 16  # stochastic rounding noise: uniform integers in [0, 2^16), exact as fp32 fractions k / 2^16
NOISE_MASK = (1 << NOISE_BITS) - 1
MASK32 = (1 << 32) - 1


def _round(x: Tensor, multiplier: int) -> Tensor:
    """One xorshift-multiply round of the hash on int32 ``x`` holding an unsigned 32-bit value: the shift is made
    logical by masking and the product wraps modulo 2^32, so the bits are the unsigned hash's on every backend."""
    return (x ^ ((x >> 16) & 0xFFFF)) * multiplier


def counter_hash(counter: Tensor, key: Tensor | int) -> Tensor:
    """32 uniform random bits (int32) per element of the int32 ``counter``, keyed by the int32 ``key`` (a scalar, or a
    tensor broadcast against ``counter``). Pure integer ops: Inductor fuses it into the loop that uses it."""
    return keyed_hash(counter_mix(counter), key)


def counter_mix(counter: Tensor) -> Tensor:
    """The first round of :func:`counter_hash`, the part that does not depend on the key: where the same counters
    are hashed under many keys (a parameter's noise keys, step after step), it is computed once."""
    return _round(counter, 0x7FEB352D)


def keyed_hash(mixed: Tensor, key: Tensor | int) -> Tensor:
    """The rest of :func:`counter_hash`: ``counter_hash(c, key) == keyed_hash(counter_mix(c), key)``."""
    x = _round(_round(mixed ^ key, 0x2C1B3C6D), 0x297A2D39)
    return x ^ ((x >> 15) & 0x1FFFF)


def as_int32(value: int) -> int:
    """``value`` modulo 2^32 as a signed 32-bit integer (what an int32 tensor holds)."""
    value &= MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def mix32(value: int) -> int:
    """A 32-bit integer hash (murmur3's finalizer) in Python ints: keys derived on the host without device work."""
    value &= MASK32
    value ^= value >> 16
    value = (value * 0x85EBCA6B) & MASK32
    value ^= value >> 13
    value = (value * 0xC2B2AE35) & MASK32
    return value ^ (value >> 16)


def counter_bits(keys: Tensor, numel: int) -> tuple[Tensor, Tensor]:
    """Two independent noise tensors in [0, 2^NOISE_BITS) for ``numel`` elements, the high and low halves of
    :func:`counter_hash` of each element's index plus ``keys[0]``, keyed by ``keys[1]`` (``keys``: two 32-bit values,
    any integer dtype)."""
    keys = keys.to(torch.int64)
    start, key = ((keys + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32).unbind()
    x = counter_hash(torch.arange(numel, dtype=torch.int32, device=keys.device) + start, key)
    return (x >> 16) & NOISE_MASK, x & NOISE_MASK
