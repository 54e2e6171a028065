"""IncrementalDetokenizer: no broken UTF-8, stop strings never emitted, deltas add up."""
from __future__ import annotations

import pytest

from sloserve.engine.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """A byte-level fake: every id maps to a byte string; decode joins and decodes with
    errors="replace" like a byte-level BPE tokenizer, so a token may end mid-character."""

    SPECIAL = 0  # decodes to "<s>" unless special tokens are skipped

    def __init__(self):
        self.vocab: dict[int, bytes] = {self.SPECIAL: b"<s>"}

    def add(self, piece: bytes | str) -> int:
        if isinstance(piece, str):
            piece = piece.encode()
        for i, b in self.vocab.items():
            if b == piece and i != self.SPECIAL:
                return i
        i = len(self.vocab)
        self.vocab[i] = piece
        return i

    def ids(self, *pieces: bytes | str) -> list[int]:
        return [self.add(p) for p in pieces]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = b"".join(b"" if (i == self.SPECIAL and skip_special_tokens) else self.vocab[i]
                        for i in ids)
        return data.decode("utf-8", errors="replace")


def byte_pieces(text: str, cuts: list[int]) -> list[bytes]:
    """Split text's UTF-8 bytes at the given byte offsets."""
    data = text.encode()
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def stream(tok, prompt_ids, out_ids, stop=(), finish=True):
    d = IncrementalDetokenizer(tok, prompt_ids, list(stop))
    deltas = []
    for k, t in enumerate(out_ids):
        deltas.append(d.add_token(t, finished=finish and k == len(out_ids) - 1))
        if d.stopped:
            break
    return d, deltas


@pytest.fixture
def tok():
    return ByteTokenizer()


# ----------------------------------------------------------------------------- UTF-8
@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀 ok", "a€b𝄞c"])
def test_every_byte_split_never_emits_replacement_char(tok, text):
    prompt = tok.ids("ctx ")
    data = text.encode()
    # one token per byte: the worst case
    d, deltas = stream(tok, prompt, tok.ids(*[data[i:i + 1] for i in range(len(data))]))
    assert all(REPLACEMENT not in x for x in deltas)
    assert "".join(deltas) == d.text == text


@pytest.mark.parametrize("cuts", [[1], [2], [1, 2], [4, 7], [3, 5, 9], [6]])
def test_multibyte_split_at_various_offsets(tok, cuts):
    text = "日本🎉x"  # 3 + 3 + 4 + 1 bytes
    pieces = byte_pieces(text, cuts)
    d, deltas = stream(tok, tok.ids("p"), tok.ids(*pieces))
    assert all(REPLACEMENT not in x for x in deltas)
    assert "".join(deltas) == text


def test_incomplete_char_is_held_then_released(tok):
    e = "€".encode()  # 3 bytes
    ids = tok.ids(b"a", e[:1], e[1:2], e[2:] + b"b")
    d = IncrementalDetokenizer(tok, tok.ids("p"), [])
    assert d.add_token(ids[0]) == "a"
    assert d.add_token(ids[1]) == ""
    assert d.add_token(ids[2]) == ""
    assert d.add_token(ids[3]) == "€b"
    assert d.text == "a€b"


def test_token_completing_one_char_and_starting_another(tok):
    a, b = "日".encode(), "本".encode()
    ids = tok.ids(a[:2], a[2:] + b[:1], b[1:])
    d = IncrementalDetokenizer(tok, tok.ids("p"), [])
    deltas = [d.add_token(t) for t in ids]
    assert all(REPLACEMENT not in x for x in deltas)
    assert "".join(deltas) == "日本"
    assert deltas[-1].endswith("本")


def test_finished_while_char_incomplete_emits_no_replacement(tok):
    e = "€".encode()
    d, deltas = stream(tok, tok.ids("p"), tok.ids("ok", e[:2]))
    assert all(REPLACEMENT not in x for x in deltas)
    assert "".join(deltas) == d.text == "ok"


def test_special_tokens_skipped(tok):
    d, deltas = stream(tok, tok.ids("p"), [tok.add("hi"), ByteTokenizer.SPECIAL, tok.add("!")])
    assert "".join(deltas) == d.text == "hi!"


def test_special_tokens_kept_when_not_skipped(tok):
    d = IncrementalDetokenizer(tok, tok.ids("p"), [], skip_special_tokens=False)
    out = d.add_token(tok.add("hi")) + d.add_token(ByteTokenizer.SPECIAL, finished=True)
    assert out == d.text == "hi<s>"


def test_prompt_text_is_not_emitted(tok):
    prompt = tok.ids("The ", "prompt ", "is ", "long ", "and ", "has ", "many ", "tokens")
    d, deltas = stream(tok, prompt, tok.ids(" out", "put"))
    assert "".join(deltas) == d.text == " output"


# ----------------------------------------------------------------------------- stop strings
def test_stop_string_ending_inside_a_token(tok):
    d, deltas = stream(tok, tok.ids("p"), tok.ids("Hel", "lo wor", "ld"), stop=["o w"])
    assert d.stopped
    assert d.text == "Hell"
    assert "".join(deltas) == "Hell"
    assert len(deltas) == 2           # stops at the token containing the match


def test_stop_string_spanning_several_tokens(tok):
    d = IncrementalDetokenizer(tok, tok.ids("p"), ["STOP"])
    assert d.add_token(tok.add("ab")) == "ab"
    assert d.add_token(tok.add("cS")) == "c"     # "S" might begin the stop string: held
    assert d.add_token(tok.add("T")) == ""
    assert d.add_token(tok.add("O")) == ""
    assert not d.stopped
    assert d.add_token(tok.add("Pxyz")) == ""
    assert d.stopped and d.text == "abc"
    assert d.add_token(tok.add("more")) == ""
    assert d.add_token(tok.add("more"), finished=True) == ""
    assert d.text == "abc"


def test_held_back_prefix_released_when_match_fails(tok):
    d = IncrementalDetokenizer(tok, tok.ids("p"), ["STOP"])
    assert d.add_token(tok.add("xST")) == "x"
    assert d.add_token(tok.add("Oa")) == "STOa"
    assert not d.stopped and d.text == "xSTOa"


def test_finished_flushes_held_back_text(tok):
    d = IncrementalDetokenizer(tok, tok.ids("p"), ["STOP"])
    assert d.add_token(tok.add("xST")) == "x"
    assert d.add_token(None, finished=True) == "ST"       # e.g. hidden EOS
    assert d.text == "xST" and not d.stopped


def test_finished_with_last_token_flushes(tok):
    d = IncrementalDetokenizer(tok, tok.ids("p"), ["STOP"])
    assert d.add_token(tok.add("a")) == "a"
    assert d.add_token(tok.add("STO"), finished=True) == "STO"


def test_stop_string_in_first_token(tok):
    d, deltas = stream(tok, tok.ids("p"), tok.ids("\n\nrest"), stop=["\n"])
    assert d.stopped and d.text == "" and deltas == [""]


def test_earliest_of_several_stop_strings_wins(tok):
    d, deltas = stream(tok, tok.ids("p"), tok.ids("one two", " three"), stop=["three", "two"])
    assert d.text == "one " and "".join(deltas) == "one "


def test_overlapping_stop_strings(tok):
    d, deltas = stream(tok, tok.ids("p"), tok.ids("xa", "b", "c", "d"), stop=["abcd", "bc"])
    assert d.text == "xa" and "".join(deltas) == "xa"


def test_stop_string_with_multibyte_char_split_across_tokens(tok):
    data = "ab日本cd".encode()
    pieces = [data[i:i + 1] for i in range(len(data))]
    d, deltas = stream(tok, tok.ids("p"), tok.ids(*pieces), stop=["本c"])
    assert d.stopped and d.text == "ab日"
    assert "".join(deltas) == "ab日"
    assert all(REPLACEMENT not in x for x in deltas)


def test_nothing_of_the_stop_string_is_ever_emitted(tok):
    """Brute force over token boundaries: the stop string's characters never leak, and the text
    before it always arrives whole."""
    text = "say <|end|> now"
    stop = "<|end|>"
    data = text.encode()
    for cut1 in range(1, len(data)):
        for cut2 in range(cut1 + 1, len(data) + 1):
            pieces = byte_pieces(text, [cut1, cut2])
            d, deltas = stream(tok, tok.ids("p"), tok.ids(*pieces), stop=[stop])
            joined = "".join(deltas)
            assert d.stopped, (cut1, cut2)
            assert joined == d.text == "say ", (cut1, cut2, deltas)
            assert "<" not in joined


def test_no_stop_strings_emits_everything_immediately(tok):
    d = IncrementalDetokenizer(tok, tok.ids("p"), [])
    assert d.add_token(tok.add("abc")) == "abc"
    assert d.add_token(tok.add("<")) == "<"


# ----------------------------------------------------------------------------- real tokenizer
REAL_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: 日本語のテキスト, emoji 🎉🚀👩‍💻, math ∑∫√ and Ελληνικά.",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
]


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_tokenizer_stream_matches_full_decode(smol_tokenizer, text):
    tok = smol_tokenizer
    prompt = tok.encode("Hello there, here is some text:", add_special_tokens=False)
    out = tok.encode(text, add_special_tokens=False)
    d, deltas = stream(tok, prompt, out)
    assert all(REPLACEMENT not in x for x in deltas)
    assert "".join(deltas) == d.text == tok.decode(out) == text


def test_real_tokenizer_splits_chars_across_tokens(smol_tokenizer):
    """The test text really contains tokens that end mid-character (else the test above would not
    cover held-back UTF-8)."""
    tok = smol_tokenizer
    ids = tok.encode(REAL_TEXTS[1], add_special_tokens=False)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("stop,expected", [
    ("日本", "Ünïcödé: "),            # stop string made of split multi-byte characters
    ("🚀", "Ünïcödé: 日本語のテキスト, emoji 🎉"),
    ("c\u00f6d", "Ünï"),              # ends inside a token
    (", emoji", "Ünïcödé: 日本語のテキスト"),
    ("not there", None),
])
def test_real_tokenizer_stop_strings(smol_tokenizer, stop, expected):
    tok = smol_tokenizer
    text = REAL_TEXTS[1]
    prompt = tok.encode("Say:", add_special_tokens=False)
    out = tok.encode(text, add_special_tokens=False)
    d, deltas = stream(tok, prompt, out, stop=[stop])
    joined = "".join(deltas)
    assert all(REPLACEMENT not in x for x in deltas)
    if expected is None:
        assert not d.stopped and joined == text
    else:
        assert d.stopped
        assert joined == d.text == expected
        assert stop not in joined


def test_real_tokenizer_leading_space_of_first_output_token(smol_tokenizer):
    tok = smol_tokenizer
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    out = tok.encode(" Paris, of course.", add_special_tokens=False)
    d, deltas = stream(tok, prompt, out)
    assert "".join(deltas) == " Paris, of course."
