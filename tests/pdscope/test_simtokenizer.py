"""The simulator's tokenizer: deterministic, word-counted, and prefix-stable for chats."""

from __future__ import annotations

import subprocess
import sys

from pdscope import simtokenizer as st


def test_one_id_per_word_and_stable_across_processes() -> None:
    ids = st.text_ids("the quick  brown\nfox")
    assert len(ids) == 4
    assert ids[0] != ids[1]
    assert st.text_ids("") == st.text_ids("   ") and len(st.text_ids("")) == 1
    code = "from pdscope.simtokenizer import text_ids; print(text_ids('the quick brown fox'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(ids)  # not Python's salted hash


def test_ids_stay_in_the_vocabulary() -> None:
    ids = st.text_ids(" ".join(f"w{i}" for i in range(2000)))
    assert all(16 <= i < st.VOCAB for i in ids)


def test_chat_counts_four_per_message_and_history_is_a_prefix() -> None:
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    a, b = st.chat_ids(turn1), st.chat_ids(turn2)
    assert len(a) == 4 * 2 + 4
    assert b[: len(a)] == a
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]
    assert st.chat_ids(parts) == st.chat_ids([{"role": "user", "content": "hi there"}])
    assert st.chat_ids([{"role": "user", "content": "x"}]) != st.chat_ids(
        [{"role": "system", "content": "x"}]
    )
    assert len(st.chat_ids(["not a dict"])) == 4
