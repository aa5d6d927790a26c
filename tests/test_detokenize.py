"""Incremental detokenization: the streamed deltas add up to exactly the final text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cats.loop.text import IncrementalDetokenizer
from tests.conftest import SMOLLM2, needs


class CharTokenizer:
    """One token per character; ``cleanup`` drops a space before '.' as some tokenizers' decode does."""

    def __init__(self, cleanup: bool = False):
        self.cleanup = cleanup

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(map(chr, ids))
        return text.replace(" .", ".") if self.cleanup else text


def stream(detokenizer, ids, step=1) -> list[str]:
    deltas = [detokenizer.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return deltas + [detokenizer.finish()]


def test_stop_strings_are_held_back_and_cut():
    detokenizer = IncrementalDetokenizer(CharTokenizer(), stop=["world"])
    deltas = stream(detokenizer, [ord(c) for c in "Hello, wonderful world! More"])
    assert "".join(deltas) == detokenizer.text() == "Hello, wonderful "  # tokens after the stop are ignored
    assert "wonderful" in "".join(deltas[:20])  # a partial match ("wo") is released once it fails


def test_a_stop_string_that_a_dropped_space_completes_is_never_sent():
    detokenizer = IncrementalDetokenizer(CharTokenizer(cleanup=True), stop=[".."])
    deltas = stream(detokenizer, [ord(c) for c in ". ."])  # decodes to "..": the stop string at the very start
    assert "".join(deltas) == detokenizer.text() == ""


def test_trailing_space_waits_for_the_next_token():
    detokenizer = IncrementalDetokenizer(CharTokenizer(cleanup=True))
    assert [detokenizer.add([ord(c)]) for c in "a ."] == ["a", "", "."]
    assert detokenizer.finish() == "" and detokenizer.text() == "a."


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab .\n", max_size=40), stops=st.lists(st.text(alphabet="ab .", min_size=1, max_size=4),
                                                                     max_size=2),
       step=st.integers(1, 4), cleanup=st.booleans())
def test_deltas_add_up_to_the_final_text(text, stops, step, cleanup):
    tokenizer = CharTokenizer(cleanup)
    ids = [ord(c) for c in text]
    # the decode loop ends at the first token that completes a stop string
    ends = [n for n in range(1, len(ids) + 1) if any(s in tokenizer.decode(ids[:n]) for s in stops)]
    ids = ids[: ends[0]] if ends else ids
    full = tokenizer.decode(ids)
    cut = min([i for i in (full.find(s) for s in stops) if i >= 0], default=len(full))
    detokenizer = IncrementalDetokenizer(tokenizer, stop=stops)
    assert "".join(stream(detokenizer, ids, step)) == detokenizer.text() == full[:cut]


@needs(SMOLLM2 / "hf-config-tokenizer")
def test_multi_byte_characters_split_across_byte_level_tokens():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2 / "hf-config-tokenizer")
    text = "Café au lait — 猫は可愛い 🐈‍⬛ and naïve façades , ok ."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode(ids[: i + 1]) for i in range(len(ids)))  # some tokens split characters
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = stream(detokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas)
