"""Character sets as code point ranges, and their UTF-8 encodings as byte-range sequences.

Regex character classes (`[a-z]`, `\\d`, `.`, ...) become sorted, merged tuples of inclusive code point
ranges. Surrogates (U+D800..U+DFFF) are never part of a set: UTF-8 cannot encode them, so no text a
tokenizer decodes can contain them.
"""

from __future__ import annotations

import functools
import re

Ranges = tuple[tuple[int, int], ...]

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
ALL: Ranges = ((0, SURROGATES[0] - 1), (SURROGATES[1] + 1, MAX_CODE_POINT))


def normalize(ranges) -> Ranges:
    """Sorts and merges inclusive ranges and removes surrogates."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out: list[tuple[int, int]] = []
    for lo, hi in merged:
        if hi < SURROGATES[0] or lo > SURROGATES[1]:
            out.append((lo, hi))
            continue
        if lo < SURROGATES[0]:
            out.append((lo, SURROGATES[0] - 1))
        if hi > SURROGATES[1]:
            out.append((SURROGATES[1] + 1, hi))
    return tuple(out)


def complement(ranges: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in normalize(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE_POINT:
        out.append((nxt, MAX_CODE_POINT))
    return normalize(out)


def subtract(ranges: Ranges, removed: Ranges) -> Ranges:
    return intersect(ranges, complement(removed))


def intersect(a: Ranges, b: Ranges) -> Ranges:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


@functools.lru_cache(maxsize=1)
def _all_chars() -> str:
    """Every encodable code point once, in order: the haystack for `ranges_matching`."""
    return "".join(map(chr, range(SURROGATES[0]))) + "".join(map(chr, range(SURROGATES[1] + 1, MAX_CODE_POINT + 1)))


@functools.lru_cache(maxsize=512)
def ranges_matching(char_class: str, flags: int) -> Ranges:
    """The code points that Python's `re` matches with the one-character pattern `char_class` under `flags`.

    Python itself is the definition here (unicode `\\w`, `\\d`, `\\s`, case folding under IGNORECASE), so
    classes mean exactly what they mean to `re`. One C-speed scan over all code points, cached.
    """
    haystack = _all_chars()
    gap = SURROGATES[1] - SURROGATES[0] + 1
    out = []
    for m in re.finditer(f"(?:{char_class})+", haystack, flags):
        lo, hi = m.start(), m.end() - 1
        # positions after the surrogate gap are shifted by its size
        if lo >= SURROGATES[0]:
            lo += gap
        if hi >= SURROGATES[0]:
            hi += gap
        out.append((lo, hi))
    return normalize(out)


def _utf8_split(lo: int, hi: int, out: list[tuple[tuple[int, int], ...]]) -> None:
    # Same encoded length on both ends first, then split until every byte position is a plain range.
    for bound in (0x7F, 0x7FF, 0xFFFF):
        if lo <= bound < hi:
            _utf8_split(lo, bound, out)
            _utf8_split(bound + 1, hi, out)
            return
    n = len(chr(lo).encode())
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                _utf8_split(lo, lo | m, out)
                _utf8_split((lo | m) + 1, hi, out)
                return
            if hi & m != m:
                _utf8_split(lo, (hi & ~m) - 1, out)
                _utf8_split(hi & ~m, hi, out)
                return
    out.append(tuple(zip(chr(lo).encode(), chr(hi).encode())))


@functools.lru_cache(maxsize=1024)
def utf8_sequences(ranges: Ranges) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The UTF-8 encodings of a code point set as sequences of inclusive byte ranges.

    Each sequence matches a run of code points whose encodings differ only within those ranges, e.g.
    U+0080..U+07FF is [(0xC2, 0xDF), (0x80, 0xBF)].
    """
    out: list[tuple[tuple[int, int], ...]] = []
    for lo, hi in normalize(ranges):
        _utf8_split(lo, hi, out)
    return tuple(out)
