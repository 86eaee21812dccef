"""The low-precision number formats `accucmp whatif` predicts casts to, as data, and their
exact casts (torch-free, numpy only).

A format is a row of FORMATS (mantissa bits, smallest normal exponent, largest finite value,
whether it saturates); round_to re-implements torch's cast to it as round-to-nearest-even on
float64 copies, and mx_quantize the OCP Microscaling v1.0 MXFP8 cast (blocks of MX_BLOCK
values sharing a power-of-two scale, e4m3 elements). The tests check them bit for bit
against `tensor.to(dtype)` in torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


MX_BLOCK = 32


@dataclass(frozen=True)
class Format:
    name: str           # as given on the command line
    torch_name: str     # torch dtype name, for messages and tests
    man_bits: int
    emin: int           # exponent of the smallest normal
    max_finite: float
    saturates: bool     # beyond max_finite -> +-max_finite instead of inf

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.emin - self.man_bits)

    @property
    def overflow_threshold(self) -> float:
        """Smallest magnitude that rounds beyond max_finite (ties go to the even, larger one)."""
        e = math.frexp(self.max_finite)[1] - 1
        return self.max_finite + math.ldexp(1.0, e - self.man_bits - 1)


# The formats as data: adding one is a row here (and a torch dtype name in the tests).
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("bf16", "bfloat16", 7, -126, float.fromhex("0x1.fep127"), False),
    Format("fp16", "float16", 10, -14, 65504.0, False),
    Format("fp8_e4m3", "float8_e4m3fn", 3, -6, 448.0, True),
    Format("fp8_e5m2", "float8_e5m2", 2, -14, 57344.0, False),
)}


MX_ELEMENT = FORMATS["fp8_e4m3"]


MX_NAMES = ("mxfp8",)


ALL_NAMES = tuple(FORMATS) + MX_NAMES


ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "e4m3": "fp8_e4m3",
           "float8_e4m3fn": "fp8_e4m3", "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
           "mxfp8_e4m3": "mxfp8"}


def format_of(dtype: str) -> Format | None:
    """The Format of a dump's dtype name ('bfloat16', 'float16', 'float8_e4m3fn'), or None."""
    return FORMATS.get(ALIASES.get(dtype, dtype))


def parse_dtypes(value: str) -> list[str]:
    names = [ALIASES.get(n.strip().lower(), n.strip().lower()) for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in ALL_NAMES]
    if bad or not names:
        raise ValueError(f"--dtype: unknown format(s) {', '.join(bad) or '(none)'} "
                         f"(choose from {', '.join(ALL_NAMES)})")
    return list(dict.fromkeys(names))


# ---- exact casts ---------------------------------------------------------------------
def round_to(x: np.ndarray, fmt: Format) -> np.ndarray:
    """float64 values -> the float64 values `torch.tensor(x, float32).to(fmt)` gives.

    x must be exactly representable in float32 (it is: dumps hold <= 32-bit floats). The
    quantum of each value is 2^(max(e, emin) - man_bits); dividing by a power of two is exact
    in float64, and np.round rounds half to even, so this is the format's RNE.
    """
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    q = spacing(a, fmt)
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.round(a / q) * q
        big = r > fmt.max_finite           # inf input: a/q = inf, also > max_finite
        r = np.where(big, fmt.max_finite if fmt.saturates else np.inf, r)
        r = np.where(np.isnan(a), np.nan, r)
    return np.copysign(r, x)


def spacing(x: np.ndarray, fmt: Format) -> np.ndarray:
    """The distance between consecutive `fmt` values at each |x| (float64): 2^(max(e, emin) -
    man_bits), e the exponent of |x| (the subnormal spacing at 0), as round_to's quantum.
    (At a power of two it is the spacing above; the one below is half of it.)"""
    a = np.abs(np.asarray(x, dtype=np.float64))
    with np.errstate(invalid="ignore", over="ignore"):
        _, k = np.frexp(a)
        # (frexp gives 0 an exponent of 0: its spacing is the subnormal one, as any value's
        # below the smallest normal)
        e = np.where(a > 0, np.maximum(k.astype(np.int64) - 1, fmt.emin), fmt.emin)
        return np.ldexp(1.0, e - fmt.man_bits)


def mx_scale_exponents(blocks: np.ndarray) -> np.ndarray:
    """(n, 32) float64 blocks -> each block's shared exponent (OCP MX: floor(log2 amax) - emax_elem).
    All-zero (or all non-finite) blocks get the smallest scale; their values stay zero."""
    fin = np.where(np.isfinite(blocks), np.abs(blocks), 0.0)
    amax = fin.max(axis=1)
    _, k = np.frexp(amax)
    emax_elem = math.frexp(MX_ELEMENT.max_finite)[1] - 1      # 8 for e4m3
    shared = np.where(amax > 0, k.astype(np.int64) - 1 - emax_elem, -127)
    return np.clip(shared, -127, 127)


def mx_quantize(blocks: np.ndarray) -> np.ndarray:
    """(n, 32) float64 -> dequantized MXFP8 values (e4m3 elements, saturating)."""
    scale = np.ldexp(1.0, mx_scale_exponents(blocks))[:, None]
    return round_to(blocks / scale, MX_ELEMENT) * scale


def best_scale_log2(amax: float, amin: float, fmt: Format) -> int | None:
    """Largest k with amax*2^k below overflow and amin*2^k not rounding to zero, or None."""
    if not (amax > 0 and math.isfinite(amin)):
        return 0
    k = math.floor(math.log2(fmt.overflow_threshold / amax))
    while math.ldexp(amax, k) >= fmt.overflow_threshold:
        k -= 1
    while math.ldexp(amax, k + 1) < fmt.overflow_threshold:
        k += 1
    # amin*2^k rounds to zero when it is <= half the smallest subnormal (the tie goes to 0)
    if math.ldexp(amin, k) <= fmt.min_subnormal / 2:
        return None
    return k
