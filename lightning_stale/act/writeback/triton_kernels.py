"""The write-back's Triton kernels: the torch families' updates (:func:`.families.torch_adam.adam`,
:func:`.families.torch_sgd.sgd`) over a whole bucket in one launch, giving their eager ops' bits.

Imported only by :mod:`.triton_pass` (Triton is optional). One program per chunk of one tensor (``chunks``: tensor
index and chunk index per program, built once per bucket, as torch's ``multi_tensor_apply`` lists its chunks); each
program walks its chunk in blocks, reading each element of each column once and writing it once. Tensors are found
through tables of their addresses (int64, one row per column) and element counts; offsets are int64, so a tensor may
have more than 2^31 elements. The bits: bf16 is read, rounded and written by integer ops on its fp32 bit pattern (as
:mod:`lightning_stale.formats.floats`; a plain cast rounds on a GPU and truncates in Triton's interpreter), division
and square root are the correctly rounded ones, products and sums stay apart (launched with ``enable_fp_fusion``
off: no fused multiply-add), and the noise is :func:`lightning_stale.formats.noise.counter_hash` in int32 arithmetic
(wrapping products, shifts made logical by masks), drawn only where a rounding is stochastic.
"""

from __future__ import annotations

import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------------------------
# Element access by storage dtype: bf16 through its bits (int16), fp16 and fp32 natively


@triton.jit
def _pointer(table, index, DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    """Entry ``index`` of an int64 address table as a pointer to ``DTYPE`` elements (int16 for bf16), with the
    byte alignment ``ALIGN`` every address of the bucket has (what lets the compiler vectorize)."""
    address = tl.load(table + index)
    if DTYPE == tl.bfloat16:
        pointer = address.to(tl.pointer_type(tl.int16))
    else:
        pointer = address.to(tl.pointer_type(DTYPE))
    return tl.multiple_of(pointer, ALIGN)


@triton.jit
def _load(pointer, offsets, mask, DTYPE: tl.constexpr):
    """Elements as fp32 (exact: a bf16 pattern is the top half of its fp32 one)."""
    if DTYPE == tl.bfloat16:
        bits = tl.load(pointer + offsets, mask=mask).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.load(pointer + offsets, mask=mask).to(tl.float32)


@triton.jit
def _nearest(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to the nearest ``DTYPE`` value, ties to even, still fp32 (``formats.floats.nearest_on_grid``;
    a NaN stays one)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = tl.add(bits, 0x7FFF + ((bits >> 16) & 1), sanitize_overflow=False) & -65536
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _store_exact(pointer, offsets, mask, x, DTYPE: tl.constexpr):
    """fp32 ``x``, already on ``DTYPE``'s grid, stored (a NaN as bf16's quiet NaN: its top half could read as inf)."""
    if DTYPE == tl.bfloat16:
        bits = tl.where(x != x, 0x7FC0, x.to(tl.int32, bitcast=True) >> 16)
        tl.store(pointer + offsets, bits.to(tl.int16), mask=mask)
    else:
        tl.store(pointer + offsets, x.to(DTYPE), mask=mask)


@triton.jit
def _store_nearest(pointer, offsets, mask, x, DTYPE: tl.constexpr):
    """fp32 ``x`` stored rounded to nearest, ties to even (the eager ``copy_``'s cast; a NaN as bf16's quiet NaN)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = tl.add(bits, 0x7FFF + ((bits >> 16) & 1), sanitize_overflow=False) >> 16
        tl.store(pointer + offsets, tl.where(x != x, 0x7FC0, rounded).to(tl.int16), mask=mask)
    else:
        tl.store(pointer + offsets, x.to(DTYPE), mask=mask)


@triton.jit
def _on_grid(x, noise, DTYPE: tl.constexpr):
    """fp32 ``x`` stochastically rounded onto ``DTYPE``'s grid with 16-bit ``noise``, saturating, still fp32
    (``formats.floats.on_grid``: bf16 adds the noise below its mantissa and truncates; fp16 shifts its subnormals
    into the lowest normal binade first, as ``stochastic_round_float``)."""
    if DTYPE == tl.bfloat16:
        top = 3.3895313892515355e38  # bf16's largest finite value
        clamped = tl.where(x > top, top, tl.where(x < -top, -top, x))
        bits = tl.add(clamped.to(tl.int32, bitcast=True), noise, sanitize_overflow=False)  # a NaN's may wrap
        return (bits & -65536).to(tl.float32, bitcast=True)
    else:
        offset = 6.103515625e-05  # 2^-14, fp16's smallest normal
        magnitude = tl.abs(x)
        magnitude = tl.where(magnitude > 65504.0, 65504.0, magnitude)
        small = magnitude < offset
        shifted = tl.where(small, magnitude + offset, magnitude)
        bits = tl.add(shifted.to(tl.int32, bitcast=True), noise >> 3, sanitize_overflow=False)  # a NaN's may wrap
        rounded = (bits & -8192).to(tl.float32, bitcast=True)
        rounded = tl.where(small, rounded - offset, rounded)
        signed = (rounded.to(tl.int32, bitcast=True) & 0x7FFFFFFF) | (x.to(tl.int32, bitcast=True) & -2147483648)
        return signed.to(tl.float32, bitcast=True)


# --------------------------------------------------------------------------------------------------------------------
# Noise: formats.noise.counter_hash


@triton.jit
def _noise(offsets, counter_offset, key):
    """32 random bits (int32) per element: ``counter_hash`` of its flat position plus ``counter_offset``, modulo
    2^32, under ``key`` (``kernels.noise``). Three xorshift-multiply rounds (``formats.noise._round``): the shifts
    made logical by masks, the products wrapping on purpose (no overflow check, even under ``TRITON_DEBUG``)."""
    x = (offsets + counter_offset).to(tl.int32)
    x = tl.mul(x ^ ((x >> 16) & 0xFFFF), 0x7FEB352D, sanitize_overflow=False) ^ key
    x = tl.mul(x ^ ((x >> 16) & 0xFFFF), 0x2C1B3C6D, sanitize_overflow=False)
    x = tl.mul(x ^ ((x >> 16) & 0xFFFF), 0x297A2D39, sanitize_overflow=False)
    return x ^ ((x >> 15) & 0x1FFFF)


# --------------------------------------------------------------------------------------------------------------------
# The weight's write (kernels.write_weight)


@triton.jit
def _write_weight(w, c, offsets, mask, new, counter_offset, key, W: tl.constexpr, HAS_C: tl.constexpr,
                  STOCHASTIC: tl.constexpr):
    """The fp32 weight ``new`` written: stochastically, compensated (its rounding residual into ``c``) or to
    nearest."""
    if STOCHASTIC:
        noise = _noise(offsets, counter_offset, key) & 0xFFFF
        _store_exact(w, offsets, mask, _on_grid(new, noise, W), W)
    elif HAS_C:
        rounded = _nearest(new, W)
        _store_nearest(c, offsets, mask, new - rounded, W)
        _store_exact(w, offsets, mask, rounded, W)
    else:
        _store_nearest(w, offsets, mask, new, W)


# --------------------------------------------------------------------------------------------------------------------
# Adam / AdamW


@triton.jit
def _adam_block(w, c, g, m, v, offsets, mask, one_minus_beta1, beta2, one_minus_beta2, sign, l2, decay, step_size,
                eps, counter_offset, key, W: tl.constexpr, G: tl.constexpr, S: tl.constexpr, HAS_C: tl.constexpr,
                AS_IS: tl.constexpr, STOCHASTIC_W: tl.constexpr, STOCHASTIC_M: tl.constexpr,
                SECOND: tl.constexpr):
    """One block of :func:`.families.torch_adam.adam`, op for op."""
    target = _load(w, offsets, mask, W)
    if HAS_C:
        target = target + _load(c, offsets, mask, W)
    grad = _load(g, offsets, mask, G)
    if not AS_IS:
        grad = grad * sign + target * l2
    mf = _load(m, offsets, mask, S)
    mf = mf + (grad - mf) * one_minus_beta1
    vf = _load(v, offsets, mask, S) * beta2 + (grad * grad) * one_minus_beta2
    new = target * decay + step_size * tl.div_rn(mf, tl.sqrt_rn(vf) + eps)
    _write_weight(w, c, offsets, mask, new, counter_offset, key, W, HAS_C, STOCHASTIC_W)
    if STOCHASTIC_M:  # kernels.write_moments: the weight's draw, or a second one where the weight drew its own
        if STOCHASTIC_W:
            key = key ^ SECOND
        bits = _noise(offsets, counter_offset, key)
        _store_exact(m, offsets, mask, _on_grid(mf, bits & 0xFFFF, S), S)
        _store_exact(v, offsets, mask, _on_grid(vf, (bits >> 16) & 0xFFFF, S), S)
    else:
        _store_nearest(m, offsets, mask, mf, S)
        _store_nearest(v, offsets, mask, vf, S)


@triton.jit
def _chunk(state, grads, numels, chunks, n_chunks, n, W: tl.constexpr, G: tl.constexpr, HAS_C: tl.constexpr,
           ALIGN: tl.constexpr, CHUNK: tl.constexpr):
    """This program's chunk: its tensor ``t``, the chunk's [start, end) there (int64), and the pointers of that
    tensor's weight, residual (the weight's where there is none: never read) and gradient."""
    pid = tl.program_id(0)
    t = tl.load(chunks + pid)
    start = tl.load(chunks + n_chunks + pid).to(tl.int64) * CHUNK
    end = tl.minimum(start + CHUNK, tl.load(numels + t))
    w = _pointer(state, t, W, ALIGN)
    if HAS_C:
        c = _pointer(state, n + t, W, ALIGN)
    else:
        c = w
    return t, start, end, w, c, _pointer(grads, t, G, ALIGN)


@triton.jit(do_not_specialize=["n_chunks", "n", "row"])
def adam_kernel(state, grads, numels, chunks, n_chunks, scalars, keys, n, row, W: tl.constexpr, G: tl.constexpr,
                S: tl.constexpr, HAS_C: tl.constexpr, HAS_S: tl.constexpr, FLAG: tl.constexpr,
                STOCHASTIC_W: tl.constexpr, STOCHASTIC_M: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
                CHUNK: tl.constexpr, SECOND: tl.constexpr):
    """Adam over one chunk. ``state``: int64 (4, n) addresses of w, c, m, v; ``grads``: int64 (n,); ``numels``:
    int64 (n,); ``chunks``: int32 (2, n_chunks); ``scalars``: fp32 rows of ``row`` (``adam``'s eight); ``keys``:
    int32 (n, 2). ``FLAG``: ``gradient_as_is``; ``HAS_S`` is always True (m and v exist)."""
    t, start, end, w, c, g = _chunk(state, grads, numels, chunks, n_chunks, n, W, G, HAS_C, ALIGN, CHUNK)
    m = _pointer(state, 2 * n + t, S, ALIGN)
    v = _pointer(state, 3 * n + t, S, ALIGN)
    r = scalars + t * row
    one_minus_beta1, beta2, one_minus_beta2 = tl.load(r), tl.load(r + 1), tl.load(r + 2)
    sign, l2, decay, step_size, eps = tl.load(r + 3), tl.load(r + 4), tl.load(r + 5), tl.load(r + 6), tl.load(r + 7)
    counter_offset, key = tl.load(keys + 2 * t), tl.load(keys + 2 * t + 1)
    full = end - (end - start) % BLOCK
    for base in range(start, full, BLOCK):  # whole blocks: no mask, vectorized
        offsets = tl.arange(0, BLOCK).to(tl.int64) + tl.multiple_of(base, BLOCK)  # int64 in the interpreter too
        _adam_block(w, c, g, m, v, offsets, None, one_minus_beta1, beta2, one_minus_beta2, sign, l2, decay,
                    step_size, eps, counter_offset, key, W, G, S, HAS_C, FLAG, STOCHASTIC_W, STOCHASTIC_M, SECOND)
    if full < end:
        offsets = full + tl.arange(0, BLOCK)
        _adam_block(w, c, g, m, v, offsets, offsets < end, one_minus_beta1, beta2, one_minus_beta2, sign, l2,
                    decay, step_size, eps, counter_offset, key, W, G, S, HAS_C, FLAG, STOCHASTIC_W, STOCHASTIC_M,
                    SECOND)


# --------------------------------------------------------------------------------------------------------------------
# SGD


@triton.jit
def _sgd_block(w, c, g, b, offsets, mask, step_size, momentum, one_minus_dampening, sign, wd, counter_offset, key,
               W: tl.constexpr, G: tl.constexpr, S: tl.constexpr, HAS_C: tl.constexpr, HAS_S: tl.constexpr,
               NESTEROV: tl.constexpr, STOCHASTIC_W: tl.constexpr, STOCHASTIC_M: tl.constexpr,
               SECOND: tl.constexpr):
    """One block of :func:`.families.torch_sgd.sgd`, op for op."""
    target = _load(w, offsets, mask, W)
    if HAS_C:
        target = target + _load(c, offsets, mask, W)
    grad = _load(g, offsets, mask, G) * sign + target * wd
    if HAS_S:
        buf = _load(b, offsets, mask, S) * momentum + grad * one_minus_dampening
        if NESTEROV:
            direction = grad + buf * momentum
        else:
            direction = buf
    else:
        direction = grad
    _write_weight(w, c, offsets, mask, target + step_size * direction, counter_offset, key, W, HAS_C, STOCHASTIC_W)
    if HAS_S and STOCHASTIC_M:  # as adam's moments
        if STOCHASTIC_W:
            key = key ^ SECOND
        _store_exact(b, offsets, mask, _on_grid(buf, _noise(offsets, counter_offset, key) & 0xFFFF, S), S)
    elif HAS_S:
        _store_nearest(b, offsets, mask, buf, S)


@triton.jit(do_not_specialize=["n_chunks", "n", "row"])
def sgd_kernel(state, grads, numels, chunks, n_chunks, scalars, keys, n, row, W: tl.constexpr, G: tl.constexpr,
               S: tl.constexpr, HAS_C: tl.constexpr, HAS_S: tl.constexpr, FLAG: tl.constexpr,
               STOCHASTIC_W: tl.constexpr, STOCHASTIC_M: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
               CHUNK: tl.constexpr, SECOND: tl.constexpr):
    """SGD over one chunk, as :func:`adam_kernel` with ``state`` int64 (3, n) addresses of w, c and the momentum
    buffer (``HAS_S``: there is one), ``scalars`` ``sgd``'s five, ``FLAG``: Nesterov."""
    t, start, end, w, c, g = _chunk(state, grads, numels, chunks, n_chunks, n, W, G, HAS_C, ALIGN, CHUNK)
    if HAS_S:
        b = _pointer(state, 2 * n + t, S, ALIGN)
    else:
        b = w
    r = scalars + t * row
    step_size, momentum, one_minus_dampening = tl.load(r), tl.load(r + 1), tl.load(r + 2)
    sign, wd = tl.load(r + 3), tl.load(r + 4)
    counter_offset, key = tl.load(keys + 2 * t), tl.load(keys + 2 * t + 1)
    full = end - (end - start) % BLOCK
    for base in range(start, full, BLOCK):  # whole blocks: no mask, vectorized
        offsets = tl.arange(0, BLOCK).to(tl.int64) + tl.multiple_of(base, BLOCK)  # int64 in the interpreter too
        _sgd_block(w, c, g, b, offsets, None, step_size, momentum, one_minus_dampening, sign, wd, counter_offset,
                   key, W, G, S, HAS_C, HAS_S, FLAG, STOCHASTIC_W, STOCHASTIC_M, SECOND)
    if full < end:
        offsets = full + tl.arange(0, BLOCK)
        _sgd_block(w, c, g, b, offsets, offsets < end, step_size, momentum, one_minus_dampening, sign, wd,
                   counter_offset, key, W, G, S, HAS_C, HAS_S, FLAG, STOCHASTIC_W, STOCHASTIC_M, SECOND)
