"""GPT-2's reversible byte-to-unicode map, used to spell byte-level BPE tokens as text."""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable unicode character."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    shift = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shift)
            shift += 1
    return mapping
