#!/usr/bin/env python3
"""Split a fixed corpus with the real o200k_base (gpt-4o) regex, as a test fixture for
ferrum-tokenizer's hand-written pre-tokenizer (`PreTokenizer::Gpt4o`).

The oracle is the `regex` module (it supports `\\p{..}` classes and this exact pattern).
One-time setup, outside the repo:

    python3 -m venv /tmp/rvenv && /tmp/rvenv/bin/pip install regex

Then, from the repo root:

    /tmp/rvenv/bin/python scripts/gen_pretokenizer_fixture.py

writes crates/ferrum-tokenizer/tests/data/gpt4o_pretokenizer_splits.json:
{"source": ..., "pattern": ..., "items": [{"text": ..., "lens": [n, ...]}, ...]}
where `lens` are the pieces' lengths in code points (the pieces cover the text in order).
The corpus is deterministic: hand-picked tricky strings and seeded random mixtures of
ASCII, Latin-1, Greek, Cyrillic, CJK, Arabic, Devanagari, combining marks, digits of several
scripts, emoji, controls and whitespace (incl. \\r \\n \\t and Unicode spaces).

Only code points whose category is the same in Python's `unicodedata` tables and in the
`regex` module's (newer) tables are used, so that Unicode-version differences (ferrum uses
llama.cpp's Unicode 15.1 tables) cannot show up as mismatches.
"""
import json
import os
import random
import sys
import unicodedata

import regex

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "crates/ferrum-tokenizer/tests/data/gpt4o_pretokenizer_splits.json")

# o200k_base, as in tiktoken and in llama.cpp's comment for LLAMA_VOCAB_PRE_TYPE_GPT4O
PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
RE = regex.compile(PATTERN)

N_RANDOM = 2600
SEED = 20261124

# Fragments that random strings are built from. Each entry is drawn whole or as a single
# random code point of it (see `fragment`).
POOLS = [
    "abcdefghijklmnopqrstuvwxyz",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "'''///",
    " ",
    "  ",
    "\t",
    "\n",
    "\r",
    "\r\n",
    "\n\n",
    "\x0b\x0c",
    "\x1c\x1d\x1e\x1f",  # separators that are not White_Space
    "\x00\x07\x1b\x7f",
    "\u0085\u00a0\u1680\u2003\u2009\u202f\u205f\u3000\u2028\u2029",
    "\u200b\u200d\ufeff\u00ad",  # format characters (not whitespace)
    "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿß",
    "ÀÁÂÃÄÅÆÇÈÉÊËÌÍÎÏÐÑÒÓÔÕÖØÙÚÛÜÝÞ",
    "ªºµ¹²³¼½¾¡¿«»§¶·©®°±×÷",
    "αβγδεζηθικλμνξοπρστυφχψωάέή",
    "ΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩ",
    "ǅǈǋǲᾈᾉᾼῌῼ",  # titlecase letters (Lt)
    "ʰʲˠˡ々ーゝ〻ꜗ",  # modifier letters (Lm)
    "абвгдежзийклмнопрстуфхцчшщъыьэюяё",
    "АБВГДЕЖЗИЙКЛМНОПРСТУФХЦЧШЩЪЫЬЭЮЯЁ",
    "東京北京日本語中文漢字",
    "ひらがなカタカナ",
    "한국어조선말",
    "مرحباالعربية",
    "\u064b\u064e\u064f\u0650\u0651\u0652",  # Arabic harakat (Mn)
    "٠١٢٣٤٥٦٧٨٩",
    "،؛؟",
    "नमस्तेहिन्दी",
    "०१२३४५६७८९",
    "\u0300\u0301\u0302\u0303\u0308\u0327\u0336\u034f",  # combining marks (Mn)
    "\u0903\u093e\u0940",  # spacing marks (Mc)
    "\u20dd\u20de\u0488",  # enclosing marks (Me)
    "０１２３４５６７８９",
    "ⅠⅡⅢⅫⅰⅱ",  # letter numbers (Nl)
    "①②③⑩",
    "๐๑๒৩৪",
    "😀😂👍❤✨🎉🚀",
    "\U0001f3fd\U0001f3fb",  # skin-tone modifiers (Sk)
    "\ufe0f\ufe0e",  # variation selectors (Mn)
    "👨‍👩‍👧",
    "🇫🇷🇯🇵",
    "\ue000\uf8ff",  # private use
    "ſſſ",  # long s: (?i:'s) matches 'ſ (simple case folding)
]

WORDS = [
    "Hello", "hello", "HELLO", "HelloWorld", "helloWorld", "XMLHttpRequest", "iPhone", "McDonald",
    "don't", "DON'T", "Don'T", "it's", "IT'S", "we're", "WE'RE", "they've", "I'm", "I'M",
    "you'll", "YOU'LL", "he'd", "HE'D", "it'ſ", "'s", "'S", "'re", "'x", "''", "ÉCOLE", "École",
    "éCOLE", "naïve", "cafe\u0301", "CAFE\u0301", "e\u0301E\u0301", "ǅungla", "ǅUNGLA",
    "ΣΊΣΥΦΟΣ", "Σίσυφος", "МоскваСити", "東京Tower", "TOKYO東京", "http://x.y/z", "a/b//c",
    "12345", "1,234,567.89", "٣٤٥٦", "3.14159", "v1.2.3", "C++", "x86_64", "foo_bar", "fooBar",
    "<|endoftext|>", "<|im_start|>", "...", "?!\n/", ";\r\n", "!!\n\n", "//\n",
]

TRICKY = [
    "Hello world", " Hello  world!", "HelloWorld", "DON'T stop", "don't STOP", "12345",
    "1234567", "a\n\nb", "a \n b", "x  \n\n  y", "end  ", "  ", "\r\n\r\n", "\n", "\t\t",
    "hi!!\n\nthere", "path/to/file", "a.b/\nc", " !?\n/x", "e\u0301", "\u0301abc", "\u0301ABC",
    "\u0301X", "a\u0301B", "東京は晴れ", "😀 😀", "I'M 12345 ok", "it'ſ", "can'T", "ǅX", "Xǅ",
    "ʰA", "Aʰb", "ABCdef", "abcDEF", "aBcDeF", "  leading", "trailing  ", " \t\n", "\u3000x",
    "x\u00a0\u00a0y", "\u2028\u2029", "\r", "\r\r\n\n", "a'", "a'l", "a'll've", "'", "' s",
]


def agrees(c):
    """True when `regex` and `unicodedata` put `c` in the same general category (so the
    code point is assigned in both tables and did not change category between them)."""
    cat = unicodedata.category(c)
    if cat in ("Cn", "Cs"):
        return False
    return regex.fullmatch(r"\p{" + cat + "}", c) is not None


def random_code_point(rng):
    """A random assigned code point, mostly from the BMP."""
    while True:
        hi = 0x3000 if rng.random() < 0.5 else (0x10000 if rng.random() < 0.8 else 0x30000)
        c = chr(rng.randrange(hi))
        if agrees(c):
            return c


def fragment(rng):
    r = rng.random()
    if r < 0.25:
        return rng.choice(WORDS)
    if r < 0.35:
        return random_code_point(rng)
    pool = rng.choice(POOLS)
    if rng.random() < 0.4:
        return pool
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 4)))


def corpus():
    rng = random.Random(SEED)
    out = list(TRICKY)
    while len(out) < len(TRICKY) + N_RANDOM:
        s = "".join(fragment(rng) for _ in range(rng.randint(1, 7)))
        out.append(s)
    for s in out:
        for c in s:
            assert agrees(c), (s, c)
    return out


def split(text):
    pieces = RE.findall(text)
    assert "".join(pieces) == text, (text, pieces)
    return [len(p) for p in pieces]


def main():
    items = [{"text": s, "lens": split(s)} for s in corpus()]
    doc = {
        "source": "Python regex %s (Unicode data of unicodedata %s for filtering); generated by "
        "scripts/gen_pretokenizer_fixture.py" % (regex.__version__, unicodedata.unidata_version),
        "pattern": PATTERN,
        "items": items,
    }
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text.replace('},{"text"', '},\n{"text"') + "\n")
    print(f"wrote {OUT}: {len(items)} strings, {len(text.encode())} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
