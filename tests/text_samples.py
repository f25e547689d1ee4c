"""Deterministic, varied test strings for tokenizer comparisons."""

from __future__ import annotations

import random

WORDS = ["hello", "world", "The", "quick", "BROWN", "fox", "jumps", "über", "naïve", "café", "résumé",
         "Ελληνικά", "русский", "язык", "עברית", "العربية", "हिन्दी", "ภาษาไทย", "中文", "字符", "日本語",
         "ひらがな", "カタカナ", "한국어", "Türkçe", "ĳssel", "straße", "ǅemal", "ℌ𝔢𝔩𝔩𝔬", "ｆｕｌｌｗｉｄｔｈ"]
CONTRACTIONS = ["don't", "I'm", "we've", "they'll", "she'd", "it's", "you're", "DON'T", "I'LL", "We'Re", "'s", "''"]
DIGITS = ["0", "7", "42", "123", "2024", "31415926", "1,000,000", "3.14", "-17", "٣٤٥", "१२३", "Ⅻ", "½"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2009", "\t\t \n"]
EMOJI = ["🎉", "🙂", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🦀", "🤖", "😀😃😄", "✨", "🧑🏿‍💻"]
CODE = ["def f(x):\n    return x**2", "for (int i = 0; i < n; ++i) {}", "x = {'a': [1, 2]}", "<div class=\"a\">",
        "SELECT * FROM t;", "a->b", "#include <stdio.h>", "$HOME/.config", "λx.x", "i += 1  # why", "```py\n```"]
PUNCT = [".", ",", "!", "?", "...", "--", "—", "«»", "“quoted”", "(parens)", "[x]", "@user", "#tag", "~", "|", "•"]
OTHER = ["\u0000", "\x7f", "e\u0301", "\u200b", "\ufeff", "\U0001d11e", "\U0010fffd", "ﬁ", "Å", "A\u030a"]


def varied_strings(count: int, seed: int = 1234, allow_decomposed: bool = True) -> list[str]:
    rng = random.Random(seed)
    pools = [WORDS, WORDS, WORDS, CONTRACTIONS, DIGITS, SPACES, SPACES, EMOJI, CODE, PUNCT]
    if allow_decomposed:
        pools.append(OTHER)
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 8)):
            part = rng.choice(rng.choice(pools))
            if rng.random() < 0.2:
                part = part.upper() if rng.random() < 0.5 else part.title()
            parts.append(part)
            if rng.random() < 0.6:
                parts.append(rng.choice([" ", " ", "", "\n", "  "]))
        out.append("".join(parts))
    return out


# Hand-picked hard cases: whitespace runs, byte-level edge cases, multi-byte characters at every length.
TORTURE = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n\n", " \n \n", "\r\n\r\n", "a", " a", "a ", "  a  ", "Hello, world!",
    "Hello\n\nworld", "   leading", "trailing   ", "tabs\tand\tspaces  mixed \t\n", "1 22 333 4444 55555 666666",
    "3.14159 and 2,718", "don't stop believin'", "I'LL BE BACK", "héllo wörld ñ ç", "Ελληνικά κείμενα",
    "Русский текст, ещё", "עברית ועוד", "مرحبا بالعالم", "नमस्ते दुनिया", "สวัสดีชาวโลก", "你好，世界！", "日本語のテキスト",
    "한국어 텍스트", "🎉🎉🎉", "👨‍👩‍👧‍👦 family", "flags 🇫🇷🇯🇵", "skin 👍🏽👍🏿", "math 𝔸𝔹ℂ ∑∫√", "music 𝄞",
    "\U0010fffd private", "zero\u200bwidth", "nbsp\u00a0here", "ideographic\u3000space", "mixed 中文 and English 123",
    "def f(x):\n\treturn {'a': [1, 2, 3]}\n", "<html><body>&amp;</body></html>", "~!@#$%^&*()_+`-=[]{}|;':\",./<>?",
    "\x00\x01\x7f control", "ÅÅÅ", "ﬁne ligature", "      many spaces      ", "\n \n \n", "a\u0300\u0301\u0302",
]
