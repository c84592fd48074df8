"""Free text people write into the audit trail: reasons and actor names. One home for what is allowed.

Both are NFC-normalised first. Then:

* a *reason* (:func:`check_reason`) is refused (``ValueError`` with the why) when it holds a
  control character other than tab and newline, or a bidi embedding, override or isolate
  (U+202A-U+202E, U+2066-U+2069: they make an audit line read differently from what it says),
  or when nothing in it is visible (only spaces, zero-width and format characters, combining
  marks without a base, Hangul fillers, the Braille blank, ...);
* an *actor name* (:func:`clean_name`) keeps only printable characters, is cut to a length never
  inside a combining sequence, and is None when nothing visible is left (the caller then records
  the authenticated identity alone).

Pure: no I/O.
"""

from __future__ import annotations

import unicodedata

# Letters and symbols that draw nothing: Hangul fillers, the Braille blank, the Khmer inherent
# vowels, the halfwidth Hangul filler. Zero-width and format characters are category Cf, spaces Z*.
BLANK_LOOKING = frozenset({0x115F, 0x1160, 0x3164, 0xFFA0, 0x2800, 0x17B4, 0x17B5})
BIDI_CONTROLS = frozenset({*range(0x202A, 0x202F), *range(0x2066, 0x206A)})
_VISIBLE_CATEGORIES = ("L", "N", "P", "S")


def is_visible(ch: str) -> bool:
    """Does this character draw something on its own (a letter, digit, punctuation, symbol)?"""
    return unicodedata.category(ch)[0] in _VISIBLE_CATEGORIES and ord(ch) not in BLANK_LOOKING


def has_visible_text(text: str) -> bool:
    return any(is_visible(c) for c in text)


def check_reason(text: str) -> str:
    """``text`` NFC-normalised and stripped; ``ValueError`` saying why when it is refused."""
    text = unicodedata.normalize("NFC", text).strip()
    if any((ord(c) < 0x20 and c not in "\t\n") or 0x7F <= ord(c) < 0xA0 for c in text):
        raise ValueError("control characters are not allowed")
    if any(ord(c) in BIDI_CONTROLS for c in text):
        raise ValueError("bidi embedding, override and isolate characters are not allowed")
    if not has_visible_text(text):
        raise ValueError("must have visible text (not only spaces, marks or invisible characters)")
    return text


def clean_name(raw: str, max_chars: int) -> str | None:
    """An actor name: NFC, printable characters only, at most ``max_chars`` never cutting a base from
    its marks; None when nothing visible is left."""
    text = unicodedata.normalize("NFC", raw)
    text = "".join(c for c in text if c.isprintable() and ord(c) not in BLANK_LOOKING).strip()
    if len(text) > max_chars:
        cut = max_chars
        while cut > 0 and unicodedata.combining(text[cut]):  # never keep a base without its marks
            cut -= 1
        text = text[:cut].rstrip()
    return text if has_visible_text(text) else None
