"""Logical CU masks for ``hipExtStreamCreateWithCUMask`` (pure Python).

Bit ``i`` of the mask (word ``i // 32``, bit ``i % 32``) is CU ``i`` of the LOGICAL mask. The
driver spreads logical bits round-robin over XCDs (bit ``i`` -> XCD ``i % num_xcds``), so a run
of low bits is balanced over XCDs. Decode takes the low bits; prefill takes the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

WORD_BITS = 32


def _check_num_cus(num_cus: int) -> None:
    if not isinstance(num_cus, int) or isinstance(num_cus, bool) or num_cus <= 0:
        raise ValueError(f"num_cus={num_cus!r} is invalid: must be a positive int")


def num_words(num_cus: int) -> int:
    """Number of uint32 words needed for ``num_cus`` CUs (the ``cuMaskSize`` argument)."""
    _check_num_cus(num_cus)
    return (num_cus + WORD_BITS - 1) // WORD_BITS


def cu_mask_words(cu_ids: Iterable[int], num_cus: int) -> list[int]:
    """Mask words (uint32, little-end word first) with a bit set for each CU id in ``cu_ids``."""
    _check_num_cus(num_cus)
    words = [0] * num_words(num_cus)
    seen = False
    for cu in cu_ids:
        if not isinstance(cu, int) or isinstance(cu, bool):
            raise ValueError(f"CU id {cu!r} is invalid: must be an int in [0, {num_cus - 1}]")
        if cu < 0 or cu >= num_cus:
            raise ValueError(f"CU id {cu} is out of range: allowed 0..{num_cus - 1} (num_cus={num_cus})")
        words[cu // WORD_BITS] |= 1 << (cu % WORD_BITS)
        seen = True
    if not seen:
        raise ValueError(f"empty CU mask: at least one CU id in [0, {num_cus - 1}] is required")
    return words


def mask_to_cu_ids(words: Sequence[int], num_cus: int) -> list[int]:
    """Inverse of :func:`cu_mask_words`: the sorted CU ids whose bits are set."""
    _check_num_cus(num_cus)
    expected = num_words(num_cus)
    if len(words) != expected:
        raise ValueError(f"mask has {len(words)} words; {expected} are required for num_cus={num_cus}")
    ids: list[int] = []
    for w_index, word in enumerate(words):
        if not 0 <= word <= 0xFFFFFFFF:
            raise ValueError(f"mask word {w_index}={word!r} is not a uint32 (allowed 0..0xFFFFFFFF)")
        for bit in range(WORD_BITS):
            if word >> bit & 1:
                cu = w_index * WORD_BITS + bit
                if cu >= num_cus:
                    raise ValueError(f"mask sets CU {cu}, beyond num_cus={num_cus} (allowed 0..{num_cus - 1})")
                ids.append(cu)
    return ids


def _check_count(name: str, count: int, num_cus: int, *, allow_zero: bool = False) -> None:
    _check_num_cus(num_cus)
    low = 0 if allow_zero else 1
    if not isinstance(count, int) or isinstance(count, bool):
        raise ValueError(f"{name}={count!r} is invalid: must be an int in [{low}, {num_cus}]")
    if count < 0:
        raise ValueError(f"{name}={count} is negative: allowed {low}..{num_cus}")
    if count > num_cus:
        raise ValueError(f"{name}={count} exceeds num_cus={num_cus}: allowed {low}..{num_cus}")
    if count < low:
        raise ValueError(f"{name}={count} gives an empty mask: allowed {low}..{num_cus}")


def decode_mask(prefix_count: int, num_cus: int) -> list[int]:
    """Mask of the low ``prefix_count`` logical CUs (the decode share)."""
    _check_count("prefix_count", prefix_count, num_cus)
    return cu_mask_words(range(prefix_count), num_cus)


def prefill_mask(decode_count: int, num_cus: int) -> list[int]:
    """Complement of :func:`decode_mask` within ``num_cus`` (the prefill share)."""
    _check_count("decode_count", decode_count, num_cus, allow_zero=True)
    if decode_count == num_cus:
        raise ValueError(
            f"decode_count={decode_count} leaves prefill an empty mask: allowed 0..{num_cus - 1} (num_cus={num_cus})"
        )
    return cu_mask_words(range(decode_count, num_cus), num_cus)


def xcd_balance(words: Sequence[int], num_cus: int, num_xcds: int) -> list[int]:
    """CUs per XCD for ``words`` under the round-robin rule (bit ``i`` -> XCD ``i % num_xcds``)."""
    _check_num_cus(num_cus)
    if not isinstance(num_xcds, int) or isinstance(num_xcds, bool) or num_xcds <= 0:
        raise ValueError(f"num_xcds={num_xcds!r} is invalid: must be a positive int dividing num_cus={num_cus}")
    if num_cus % num_xcds:
        divisors = [d for d in range(1, num_cus + 1) if num_cus % d == 0]
        raise ValueError(f"num_xcds={num_xcds} does not divide num_cus={num_cus}: allowed {divisors}")
    counts = [0] * num_xcds
    for cu in mask_to_cu_ids(words, num_cus):
        counts[cu % num_xcds] += 1
    return counts


def round_to_granularity(count: int, num_cus: int, granularity: int) -> int:
    """Round ``count`` to the nearest multiple of ``granularity`` (ties round up).

    The result is clamped to ``[granularity, largest multiple <= num_cus]`` so it is never an
    empty mask. With ``granularity = num_xcds`` the low-bit mask of that size is exactly balanced.
    """
    _check_num_cus(num_cus)
    if not isinstance(granularity, int) or isinstance(granularity, bool) or granularity <= 0:
        raise ValueError(f"granularity={granularity!r} is invalid: must be a positive int <= num_cus={num_cus}")
    if granularity > num_cus:
        raise ValueError(f"granularity={granularity} exceeds num_cus={num_cus}: allowed 1..{num_cus}")
    _check_count("count", count, num_cus, allow_zero=True)
    rounded = (count + granularity // 2) // granularity * granularity
    top = num_cus // granularity * granularity
    return max(granularity, min(rounded, top))
