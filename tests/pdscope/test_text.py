"""pdscope.text: reasons and actor names must hold visible text; no control or bidi override characters."""

from __future__ import annotations

import pytest

from pdscope.text import check_reason, clean_name

INVISIBLE = [
    "\u200b",  # zero-width space
    "\u200e\u200f",  # bidi marks
    "\u202e",  # right-to-left override
    "\u2060",  # word joiner
    "\ufeff",  # BOM / zero-width no-break space
    "\u180e",  # Mongolian vowel separator
    "\u3164",  # Hangul filler
    "\u115f\u1160",  # Hangul choseong / jungseong fillers
    "\u2800",  # Braille blank
    "\u0301\u0301",  # combining marks without a base
    "\u3000 \u2003",  # ideographic and em spaces
    " \u200b \u3164 \u2800 ",
]


@pytest.mark.parametrize("text", INVISIBLE)
def test_invisible_only_text_is_refused_as_a_reason_and_absent_as_a_name(text: str) -> None:
    with pytest.raises(ValueError):
        check_reason(text)
    assert clean_name(text, 64) is None


@pytest.mark.parametrize("text", ["ok\u202eevil", "a\u2066b\u2069", "a\u0000b", "a\u001bb", "a\u0085b"])
def test_controls_and_bidi_overrides_are_refused_in_a_reason(text: str) -> None:
    with pytest.raises(ValueError):
        check_reason(text)


def test_visible_text_is_kept_nfc_and_stripped() -> None:
    assert check_reason("  Jose\u0301 drained d-1\n") == "Jos\u00e9 drained d-1"
    assert check_reason("\U0001f469\u200d\U0001f4bb rollout") == "\U0001f469\u200d\U0001f4bb rollout"  # ZWJ
    assert check_reason("\u0627\u0644\u0633\u0628\u0628") == "\u0627\u0644\u0633\u0628\u0628"  # RTL text
    assert check_reason("a\tb\nc") == "a\tb\nc"


def test_names_keep_only_printable_text() -> None:
    assert clean_name("ali\x7fce\u202e\u200b\x1b", 64) == "alice"
    assert clean_name("\u3164carol\u3164", 64) == "carol"
    assert clean_name("q\u0301" * 40, 64) == "q\u0301" * 32  # never a base without its mark
