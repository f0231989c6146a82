"""Kubernetes resource quantities ("20Gi", "1500m", "1e3", 4) as exact fractions, parsed strictly.

Resource values in pod specs and sizes in the policy are quantities; extended resources such as
``nvidia.com/gpu`` must be whole numbers. The grammar is Kubernetes' own
(k8s.io/apimachinery/pkg/api/resource, ``Quantity``): a signed decimal number of ASCII digits
followed by a binary suffix (Ki Mi Gi Ti Pi Ei), a decimal suffix (n u m k M G T P E) or a
decimal exponent (e3, E-2); no spaces. Fractions keep it exact: "0.5Gi" is 536870912 bytes, not
a float near it.

Every input here comes from someone else (a label value, an annotation, a pod spec), so parsing
is bounded before any arithmetic: at most ``MAX_CHARS`` characters, and a magnitude of at most
2^63-1 (the limit Kubernetes itself puts on a quantity) decided from the number of digits and
the exponent, never by computing the value. No work is proportional to a number's value:
"1e999999999" is refused as quickly as "2".
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Union

from xmem_admission.contract.errors import QuantityError

MAX_CHARS = 64  # "9223372036854775807" is 19; a label value is at most 63
MAX_MAGNITUDE = 2**63 - 1  # Kubernetes caps every quantity here (resource.Quantity)
MAX_DIGITS = 19  # decimal digits of MAX_MAGNITUDE
MIN_EXPONENT = -30  # smaller than any nano-quantity: refused, not rounded

_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}  # powers of two
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_PATTERN = re.compile(
    r"(?P<sign>[+-]?)(?P<int>[0-9]*)(?:\.(?P<frac>[0-9]*))?"
    r"(?:(?P<bin>[KMGTPE]i)|[eE](?P<exp>[+-]?[0-9]+)|(?P<dec>[numkMGTPE]?))",
    re.ASCII,
)
_DIGITS = re.compile(r"[0-9]{1,19}", re.ASCII)

MiB = 1 << 20
GiB = 1 << 30

QuantityLike = Union[str, int, float]


def _too_large(value: object) -> QuantityError:
    return QuantityError(f"{_shown(value)} is too large (a quantity is at most 2^63-1)")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + "..." + text[-10:]


def _exact(value: str) -> Fraction:
    if len(value) > MAX_CHARS:
        raise QuantityError(f"{_shown(value)} is not a quantity (longer than {MAX_CHARS} characters)")
    match = _PATTERN.fullmatch(value)
    if match is None or not (match.group("int") or match.group("frac")):
        raise QuantityError(
            f"{_shown(value)} is not a quantity (examples: 20Gi, 512Mi, 1500m, 2, 1e9)"
        )
    digits = match.group("int").lstrip("0")
    fraction = match.group("frac") or ""
    if not digits and not fraction.strip("0"):
        return Fraction(0)  # zero, whatever the suffix or exponent says
    if match.group("bin"):
        power_of_ten, two = 0, _BINARY[match.group("bin")]
    elif match.group("exp") is not None:
        power_of_ten, two = int(match.group("exp")), 0
    else:
        power_of_ten, two = _DECIMAL[match.group("dec") or ""], 0
    # log10 of the magnitude is below order + power_of_ten + log10(2**two) (< 0.302 * two):
    # decide the bound on that, before building anything the size of the value.
    # A number below one has its order from the zeros after the point.
    order = len(digits) if digits else len(fraction.lstrip("0")) - len(fraction)
    if order + power_of_ten + math.ceil(0.302 * two) > MAX_DIGITS + 1:
        raise _too_large(value)
    if power_of_ten < MIN_EXPONENT:
        raise QuantityError(f"{_shown(value)} is too small to be a quantity")
    scale = 10 ** len(fraction)
    numerator = (int(digits or "0") * scale + int(fraction or "0")) * (1 << two)
    if power_of_ten >= 0:
        number = Fraction(numerator * 10**power_of_ten, scale)
    else:
        number = Fraction(numerator, scale * 10**-power_of_ten)
    if number > MAX_MAGNITUDE:
        raise _too_large(value)
    return Fraction(-number.numerator, number.denominator) if match.group("sign") == "-" \
        else number


def parse(value: QuantityLike) -> Fraction:
    """The exact value of a quantity; JSON numbers are accepted as the API server accepts them."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        if abs(value) > MAX_MAGNITUDE:
            raise _too_large(value)
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
            raise QuantityError(f"{value!r} is not a quantity (at most 2^63-1)")
        return Fraction(value)
    if not isinstance(value, str):
        raise QuantityError(f"{_shown(value)} is not a quantity (expected a string or a number)")
    return _exact(value)


def parse_digits(value: object) -> int:
    """A whole number written with ASCII digits only ("8000"; not "²", "+1", " 1" or "1e3"),
    at most 19 of them: the form of the byte counts in ``xmem.io/`` annotations."""
    if not isinstance(value, str) or _DIGITS.fullmatch(value) is None:
        raise QuantityError(f"{_shown(value)} is not a whole number of ASCII digits")
    number = int(value)
    if number > MAX_MAGNITUDE:
        raise _too_large(value)
    return number


def parse_count(value: QuantityLike) -> int:
    """A whole, non-negative count such as an extended resource (``nvidia.com/gpu: 2``)."""
    if isinstance(value, str) and _DIGITS.fullmatch(value):
        return parse_digits(value)  # the usual "1", "8000": no need for the full grammar
    exact = parse(value)
    if exact.denominator != 1 or exact < 0:
        raise QuantityError(f"{_shown(value)} is not a whole non-negative number")
    return int(exact)


def parse_bytes(value: QuantityLike) -> int:
    """A size in bytes, rounded up to a whole byte (Kubernetes rounds memory up the same way)."""
    exact = parse(value)
    if exact < 0:
        raise QuantityError(f"{_shown(value)} is negative")
    return math.ceil(exact)


def ceil_div(value: int, unit: int) -> int:
    """How many ``unit``s hold ``value``: requests are always rounded up, never down."""
    return -(-value // unit)


def gib(value: int) -> str:
    """Bytes as GiB with one decimal, for messages and warnings ("12.3")."""
    return f"{value / GiB:.1f}"
