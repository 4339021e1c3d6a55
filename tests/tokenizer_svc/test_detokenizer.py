import pytest

from tokenizer_svc.detokenizer import REPLACEMENT, IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "안녕하세요, 세계! 반갑습니다.",
    "👩‍👩‍👧 and 👨‍💻 and 🏳️‍🌈 and 👍🏽",
    "你好，世界。漢字かなカナ",
    "e\u0301 a\u0300 n\u0303 q\u0307\u0323",
    "mixed: Hello 안녕 你好 😀 café ﬁ 🇰🇷 end",
    "ascii only, nothing special",
]


def stream(tokenizer, ids, context=()):
    detok = IncrementalDetokenizer(lambda x: tokenizer.decode(x), context_ids=context)
    pieces = [detok.add([i]) for i in ids]
    return pieces, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_emits_replacement(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert REPLACEMENT in "".join(tokenizer.decode([i]) for i in ids) or text.isascii()
    pieces, tail = stream(tokenizer, ids)
    assert all(REPLACEMENT not in p for p in pieces)
    assert tail == "" and "".join(pieces) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_with_prompt_context(tokenizer, text):
    prompt = tokenizer.encode("안녕 👩‍👩‍👧 prompt:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, tail = stream(tokenizer, ids, context=prompt)
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) + tail == text


def test_special_tokens_skipped_and_flush_releases_incomplete_char(tokenizer):
    eos = tokenizer.tok.token_to_id("<|endoftext|>")
    ids = tokenizer.encode("한국어", add_special_tokens=False)
    pieces, tail = stream(tokenizer, ids + [eos])
    assert "".join(pieces) + tail == "한국어"
    # Generation cut mid-character (max_tokens): the partial character comes out only at flush.
    partial = next(ids[:k] for k in range(1, len(ids) + 1)
                   if tokenizer.decode(ids[:k]).endswith(REPLACEMENT))
    pieces, tail = stream(tokenizer, partial)
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) + tail == tokenizer.decode(partial) and tail.endswith(REPLACEMENT)


def test_many_tokens_trim_the_window(tokenizer):
    ids = tokenizer.encode("안녕 😀 " * 400, add_special_tokens=False)
    pieces, tail = stream(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids)


def feed_all(stops, chunks):
    m, out = StopStringMatcher(stops), []
    for c in chunks:
        safe, matched = m.feed(c)
        out.append(safe)
        if matched:
            return "".join(out), matched
    return "".join(out) + m.flush(), None


def test_stop_string_split_across_chunks_is_never_partly_sent():
    m = StopStringMatcher(["###"])
    assert m.feed("abc#") == ("abc", None)
    assert m.feed("#") == ("", None)
    assert m.feed("#tail") == ("", "###")
    assert feed_all(["###"], ["a#", "#b"]) == ("a##b", None)


def test_stop_string_earliest_match_wins_and_no_stops_passes_through():
    assert feed_all(["world", "lo w"], ["hel", "lo wor", "ld"]) == ("hel", "lo w")
    assert feed_all([], ["a", "b"]) == ("ab", None)
    assert feed_all(["안녕"], ["인사: 안", "녕하세요"]) == ("인사: ", "안녕")
