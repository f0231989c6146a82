"""Kubernetes resource quantities ("20Gi", "1500m", "1e3", 4) as exact fractions.

Resource values in pod specs and sizes in the policy are quantities; extended resources such as
``nvidia.com/gpu`` must be whole numbers. The grammar is Kubernetes' own
(k8s.io/apimachinery/pkg/api/resource, ``Quantity``): a signed decimal number followed by a binary
suffix (Ki Mi Gi Ti Pi Ei), a decimal suffix (n u m k M G T P E) or a decimal exponent (e3, E-2).
Fractions keep it exact: "0.5Gi" is 536870912 bytes, not a float near it.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Union

from xmem_admission.contract.errors import QuantityError

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
}
_PATTERN = re.compile(
    r"^(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<bin>[KMGTPE]i)|(?P<exp>[eE][+-]?[0-9]+)|(?P<dec>[numkMGTPE]?))$"
)

MiB = 1 << 20
GiB = 1 << 30

QuantityLike = Union[str, int, float]


def parse(value: QuantityLike) -> Fraction:
    """The exact value of a quantity; JSON numbers are accepted as the API server accepts them."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise QuantityError(f"{value!r} is not a quantity")
        return Fraction(value)
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is not a quantity (expected a string or a number)")
    match = _PATTERN.match(value.strip())
    if match is None:
        raise QuantityError(
            f"{value!r} is not a quantity (examples: 20Gi, 512Mi, 1500m, 2, 1e9)"
        )
    number = Fraction(match.group("num"))
    if match.group("bin"):
        return number * _BINARY[match.group("bin")]
    if match.group("exp"):
        return number * Fraction(10) ** int(match.group("exp")[1:])
    return number * _DECIMAL[match.group("dec") or ""]


def parse_count(value: QuantityLike) -> int:
    """A whole, non-negative count such as an extended resource (``nvidia.com/gpu: 2``)."""
    if isinstance(value, str) and value.isdigit() and value.isascii():
        return int(value)  # the usual "1", "8000": no need for the full grammar
    exact = parse(value)
    if exact.denominator != 1 or exact < 0:
        raise QuantityError(f"{value!r} is not a whole non-negative number")
    return int(exact)


def parse_bytes(value: QuantityLike) -> int:
    """A size in bytes, rounded up to a whole byte (Kubernetes rounds memory up the same way)."""
    exact = parse(value)
    if exact < 0:
        raise QuantityError(f"{value!r} is negative")
    return math.ceil(exact)


def ceil_div(value: int, unit: int) -> int:
    """How many ``unit``s hold ``value``: requests are always rounded up, never down."""
    return -(-value // unit)


def gib(value: int) -> str:
    """Bytes as GiB with one decimal, for messages and warnings ("12.3")."""
    return f"{value / GiB:.1f}"
