"""Regexes for JSON numbers in ranges: the integers in [lo, hi] (int_range_regex, canonical forms), and
the numbers on one side of a bound: x > a, x >= a, x < b, x <= b, for any decimal bound (fractional,
negative, exclusive). Numbers are written without an exponent: an optional `-`, an
integer part without leading zeros, an optional fraction. Both sides of a range are intersected as
automata by the caller (json_grammar.py).

A magnitude m = I.F is compared with a bound's integer part A and fraction digits f: a larger integer
part decides, an equal one leaves the fractions to compare digit by digit (trailing zeros change
nothing: 1.50 equals 1.5).
"""

from __future__ import annotations

import math
from decimal import Decimal, InvalidOperation

MAX_FRACTION_DIGITS = 30
_FRACTION = r"(?:\.[0-9]+)?"


def int_bounds(schema: dict) -> tuple[int | None, int | None]:
    """The integers an integer schema's minimum, maximum and exclusive bounds allow: (lo, hi), None where
    unbounded. ValueError for draft 4's boolean exclusive bounds."""
    lo = hi = None
    if "minimum" in schema:
        lo = math.ceil(schema["minimum"])
    if "exclusiveMinimum" in schema and not isinstance(schema["exclusiveMinimum"], bool):
        lo = max(lo if lo is not None else -math.inf, math.floor(schema["exclusiveMinimum"]) + 1)
    if "maximum" in schema:
        hi = math.floor(schema["maximum"])
    if "exclusiveMaximum" in schema and not isinstance(schema["exclusiveMaximum"], bool):
        hi = min(hi if hi is not None else math.inf, math.ceil(schema["exclusiveMaximum"]) - 1)
    if isinstance(schema.get("exclusiveMinimum"), bool) or isinstance(schema.get("exclusiveMaximum"), bool):
        raise ValueError("boolean exclusiveMinimum/exclusiveMaximum (draft 4) are not supported")
    return (None if lo is None else int(lo)), (None if hi is None else int(hi))


def _digits_range(a: str, b: str) -> list[str]:
    """Alternatives matching the digit strings of one length from a to b (a <= b, same length)."""
    n = len(a)
    if a == b:
        return [a]
    if a == "0" * n and b == "9" * n:
        return [f"[0-9]{{{n}}}" if n > 1 else "[0-9]"]
    if n == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [a[0] + r for r in _digits_range(a[1:], b[1:])]
    out = [a[0] + r for r in _digits_range(a[1:], "9" * (n - 1))]
    if int(b[0]) - int(a[0]) > 1:
        out.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}][0-9]{{{n - 1}}}")
    out += [b[0] + r for r in _digits_range("0" * (n - 1), b[1:])]
    return out


def _natural_range(a: int, b: int | None) -> list[str]:
    """Alternatives for the canonical decimal forms of a..b (b None: unbounded), 0 <= a."""
    out = []
    top_len = len(str(b)) if b is not None else len(str(a))
    for length in range(len(str(a)), top_len + 1):
        lo = max(a, 10 ** (length - 1) if length > 1 else 0)
        hi = 10 ** length - 1 if b is None or length < len(str(b)) else b
        if lo <= hi:
            out += _digits_range(str(lo), str(hi))
    if b is None:
        out.append(f"[1-9][0-9]{{{len(str(a))},}}")
    return out


def int_range_regex(lo: int | None, hi: int | None) -> str:
    """The canonical JSON forms of the integers in [lo, hi] (None: unbounded on that side)."""
    parts = []
    if hi is None or hi >= 0:  # the non-negative part
        parts += _natural_range(max(lo, 0) if lo is not None else 0, hi)
    if lo is None or lo < 0:  # the negative part: '-' and a magnitude in [max(1, -hi), -lo]
        mags = _natural_range(max(1, -hi) if hi is not None else 1, None if lo is None else -lo)
        parts += ["-" + m for m in mags]
    return "(?:" + "|".join(parts) + ")"


def _parts(value: float | int, what: str) -> tuple[int, str]:
    """(integer part, fraction digits without trailing zeros) of a non-negative bound."""
    try:
        text = format(Decimal(str(value)), "f")
    except InvalidOperation:
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    whole, _, frac = text.partition(".")
    frac = frac.rstrip("0")
    if len(frac) > MAX_FRACTION_DIGITS:
        raise ValueError(f"{what} {value!r} has more than {MAX_FRACTION_DIGITS} fraction digits")
    return int(whole), frac


def _alt(parts: list[str]) -> str | None:
    return "(?:" + "|".join(parts) + ")" if parts else None


def _fraction_above(f: str, inclusive: bool) -> list[str]:
    """Digit strings F (one or more) with 0.F > 0.f (>= when inclusive)."""
    out = [f"{f[:i]}[{int(f[i]) + 1}-9][0-9]*" for i in range(len(f)) if f[i] != "9"]
    out.append(f"{f}[0-9]*" if inclusive else f"{f}[0-9]*[1-9][0-9]*")
    return out


def _fraction_below(f: str, inclusive: bool) -> list[str]:
    """Digit strings F (one or more) with 0.F < 0.f (<= when inclusive); f has no trailing zero."""
    out = [f"{f[:i]}[0-{int(f[i]) - 1}][0-9]*" for i in range(len(f)) if f[i] != "0"]
    out += [f[:m] for m in range(1, len(f))]  # a proper prefix of f is smaller
    if inclusive and f:
        out.append(f"{f}0*")
    return out


def _magnitudes_above(a: float | int, inclusive: bool) -> str:
    """Magnitudes m > a (>= when inclusive), a >= 0."""
    whole, f = _parts(a, "a bound")
    out = [f"(?:{'|'.join(_natural_range(whole + 1, None))}){_FRACTION}"]
    if f:
        out.append(rf"{whole}\.(?:{'|'.join(_fraction_above(f, inclusive))})")
    elif inclusive:
        out.append(rf"{whole}{_FRACTION}")
    else:
        out.append(rf"{whole}\.[0-9]*[1-9][0-9]*")
    return _alt(out)


def _magnitudes_below(b: float | int, inclusive: bool) -> str | None:
    """Magnitudes m < b (<= when inclusive), b >= 0; None if there are none."""
    whole, f = _parts(b, "a bound")
    out = [f"(?:{'|'.join(_natural_range(0, whole - 1))}){_FRACTION}"] if whole >= 1 else []
    if f:
        out.append(str(whole))
        out.append(rf"{whole}\.(?:{'|'.join(_fraction_below(f, inclusive))})")
    elif inclusive:
        out.append(rf"{whole}(?:\.0+)?")
    return _alt(out)


_ANY = r"(?:0|[1-9][0-9]*)" + _FRACTION
FRACTIONAL = r"-?(?:0|[1-9][0-9]*)\.[0-9]*[1-9][0-9]*"  # the numbers that are not integers
# At most 15 digits. Programs read numbers as doubles (json.loads), which keep 15 significant digits:
# with more, 1.1000000000000000001 reads as 1.1 (not above an exclusive 1.1) and 5.0000000000000000001
# as 5.0 (an integer). Numbers with exclusive, fractional or non-integer constraints stay within it.
ROUND_TRIP = r"-?(?:[0-9]{1,15}|[0-9.]{3,16})"


def above(a: float | int, inclusive: bool) -> str:
    """JSON numbers x > a (x >= a when inclusive)."""
    if a >= 0:
        return _magnitudes_above(a, inclusive)
    negative = _magnitudes_below(-a, inclusive)
    return _alt([_ANY] + ([f"-{negative}"] if negative else []))


def below(b: float | int, inclusive: bool) -> str | None:
    """JSON numbers x < b (x <= b when inclusive); None if there are none (never: -m reaches below)."""
    if b > 0:
        return _alt([f"-{_ANY}", _magnitudes_below(b, inclusive)])
    zero = [r"0(?:\.0+)?"] if b == 0 and inclusive else []
    return _alt([f"-{_magnitudes_above(-b, inclusive)}"] + zero)
