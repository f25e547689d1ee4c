"""Build a HF `tokenizers.Tokenizer` from a vocabulary embedded in GGUF metadata.

The `tokenizers` library does the actual tokenization; this module only translates
llama.cpp's description of a vocabulary (`tokenizer.ggml.*` keys) into the matching
HF model, normalizer, pre-tokenizer and decoder, and reads the special-token rules.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SPM_SPACE = "\u2581"  # SentencePiece's visible space "▁"

# Pre-tokenizer split regexes, applied one after the other (each splits the pieces the previous one
# left, keeping the unmatched text as pieces too, like llama.cpp's unicode_regex_split and HF's
# Split(behavior="isolated")). The expressions are the ones of the original tokenizer.json files;
# the grouping of `tokenizer.ggml.pre` names follows llama.cpp's llama-vocab.cpp.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class _PreTokenizerRule:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole pre-token found in the vocab is taken as is (Llama-3)
    add_bos: bool = False  # llama.cpp's default when the GGUF has no tokenizer.ggml.add_bos_token
    nfc: bool = False  # the original tokenizer.json normalizes to NFC first (llama.cpp does not)


_LLAMA3_RULE = _PreTokenizerRule((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_RULE = _PreTokenizerRule((_QWEN2,), nfc=True)
_GPT2_RULE = _PreTokenizerRule((_GPT2,))
_DIGITS_THEN_GPT2_RULE = _PreTokenizerRule((r"\p{N}", _GPT2))  # SmolLM: Digits(individual) + ByteLevel

PRE_TOKENIZER_RULES: dict[str, _PreTokenizerRule] = {
    # llama.cpp's own "default" BPE pre-tokenizer: punctuation runs, the GPT-2 rules, digit runs.
    "default": _PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "gpt2"), _GPT2_RULE),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "pixtral"), _LLAMA3_RULE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_RULE),
    "stablelm2": _PreTokenizerRule((_QWEN2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), _DIGITS_THEN_GPT2_RULE),
    "tekken": _PreTokenizerRule((_TEKKEN,), ignore_merges=True, add_bos=True),  # Mistral Nemo and later
    **dict.fromkeys(("gpt-4o", "llama4"), _PreTokenizerRule((_GPT4O,))),
}

# Token texts llama.cpp treats as end-of-generation even when no key names them.
END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "<|eom_id|>", "<｜end▁of▁sentence｜>",
})


@dataclass
class GGUFVocab:
    """What Tokenizer needs from a GGUF vocabulary: the HF tokenizer plus the special-token rules."""

    hf: HFTokenizer
    bos_id: int | None
    eos_id: int | None
    eos_ids: set[int] = field(default_factory=set)
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None
    kind: str = "spm"  # "spm" or "byte_level": how token texts map to bytes


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# What each tokenizer key must hold: a test of the value (of each item, for a list), whether it
# is a list, and its description for the error.
_KINDS = {
    "str": (lambda v: isinstance(v, str), False, "a string"),
    "int": (_is_int, False, "an integer"),
    "bool": (lambda v: isinstance(v, bool), False, "a boolean"),
    "str list": (lambda v: isinstance(v, str), True, "a string"),
    "int list": (_is_int, True, "an integer"),
    "number list": (_is_number, True, "a finite number"),
}


def _field(meta: dict, key: str, kind: str, default=None, length: int | None = None):
    """meta[key] (default when absent), ValueError when it is not of `kind` (naming the first
    item that is not) or, for a list, not `length` long: the metadata is refused, never coerced."""
    if key not in meta:
        return default
    value = meta[key]
    test, is_list, what = _KINDS[kind]
    if not is_list:
        if not test(value):
            raise ValueError(f"tokenizer metadata '{key}' is not {what} (got {type(value).__name__})")
        return value
    if not isinstance(value, list):
        raise ValueError(f"tokenizer metadata '{key}' is not a list (got {type(value).__name__})")
    bad = next((i for i, x in enumerate(value) if not test(x)), None)
    if bad is not None:
        raise ValueError(f"tokenizer metadata '{key}'[{bad}] is {value[bad]!r}, not {what}")
    if length is not None and len(value) != length:
        raise ValueError(f"tokenizer metadata '{key}' has {len(value)} entries for {length} tokens")
    return value


# llama.cpp's "no such token" (LLAMA_TOKEN_NULL, -1), as its converters write it: int32 or uint32.
_NO_TOKEN = (-1, 2**32 - 1)


def _special_id(meta: dict, key: str, n_tokens: int, default: int | None) -> int | None:
    """The id a special-token key names: `default` when the key is absent, None for llama.cpp's
    "no such token"; ValueError for any other id outside the vocabulary."""
    name = f"tokenizer.ggml.{key}_token_id"
    value = _field(meta, name, "int", default)
    if value is None or value in _NO_TOKEN:
        return None
    if not 0 <= value < n_tokens:
        raise ValueError(f"tokenizer metadata '{name}' is {value}, outside the vocabulary of {n_tokens} tokens")
    return value


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_TOKEN_TYPES = range(TOKEN_NORMAL, TOKEN_BYTE + 1)


def _check_tokens(tokens: list[str], types: list[int], byte_level: bool) -> None:
    """The rules every vocabulary's token list keeps (the first broken one is named with its
    token index): known token types, no token twice, and each token text what its type says.
    A byte-level vocabulary spells its model tokens in GPT-2's byte alphabet (added tokens are
    plain text); a SentencePiece vocabulary names its byte tokens <0xXX>."""
    from .tokenizer_backends import byte_level_alphabet

    alphabet = frozenset(byte_level_alphabet()) if byte_level else None
    seen: dict[str, int] = {}
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        if ttype not in _TOKEN_TYPES:
            raise ValueError(f"tokenizer metadata 'tokenizer.ggml.token_type'[{i}] is {ttype}, not a token type (1 to 6)")
        first = seen.setdefault(text, i)
        if first != i:
            raise ValueError(f"tokenizer metadata 'tokenizer.ggml.tokens'[{i}] is {text!r}, already token {first}")
        if ttype == TOKEN_BYTE and not byte_level and not _BYTE_TOKEN.fullmatch(text):
            raise ValueError(f"tokenizer metadata 'tokenizer.ggml.tokens'[{i}] is {text!r}, but "
                             f"'tokenizer.ggml.token_type'[{i}] says a byte token, which is <0xXX>")
        if alphabet is not None and ttype not in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and not alphabet.issuperset(text):
            raise ValueError(f"tokenizer metadata 'tokenizer.ggml.tokens'[{i}] is {text!r}, not in GPT-2's byte "
                             f"alphabet, as a byte-level vocabulary spells the tokens that 'tokenizer.ggml.token_type' "
                             f"does not mark as added (control or user-defined)")


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    """Control and user-defined tokens are matched in the raw text before the model sees it."""
    added = []
    for text, ttype in zip(tokens, types):
        if ttype == TOKEN_CONTROL:
            added.append(AddedToken(text, special=True, normalized=False))
        elif ttype == TOKEN_USER_DEFINED:
            added.append(AddedToken(text, special=False, normalized=False))
    return added


def spm_merges_from_scores(vocab: dict[str, int], scores: list[float], mergeable: set[str]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges greedily by the score of the merged piece; an HF BPE merges by rank.

    Every split of a mergeable piece into two vocabulary pieces becomes a merge, ranked by the
    merged piece's score (best first), so HF's lowest-rank-first order is SentencePiece's order.
    """
    ranked = []
    for piece in mergeable:
        piece_id = vocab[piece]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[piece_id], piece_id, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(tokens: list[str], scores: list[float], types: list[int], *,
                        unk_id: int | None, add_space_prefix: bool = True) -> HFTokenizer:
    """A byte-fallback BPE that tokenizes like SentencePiece (and llama.cpp's SPM vocab)."""
    vocab = {text: i for i, text in enumerate(tokens)}
    mergeable = {t for t, ty in zip(tokens, types) if ty == TOKEN_NORMAL and len(t) > 1}
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(vocab=vocab, merges=spm_merges_from_scores(vocab, scores, mergeable),
                       unk_token=unk, byte_fallback=True, fuse_unk=True)
    hf = HFTokenizer(model)
    steps = [normalizers.Replace(" ", SPM_SPACE)]
    if add_space_prefix:
        # Applied per text segment between special tokens, as llama.cpp adds the space after each one.
        steps.insert(0, normalizers.Prepend(SPM_SPACE))
    hf.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))  # drop the dummy prefix again
    hf.decoder = decoders.Sequence(decode_steps)
    hf.add_tokens(_added_tokens(tokens, types))
    return hf


def build_byte_level_tokenizer(tokens: list[str], merges: list[str], types: list[int], pre: str) -> HFTokenizer:
    """A GPT-2 style byte-level BPE with the pre-tokenizer that `tokenizer.ggml.pre` names."""
    rule = PRE_TOKENIZER_RULES.get(pre)
    if rule is None:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r}; known: {sorted(PRE_TOKENIZER_RULES)}")
    vocab = {text: i for i, text in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=rule.ignore_merges))
    if rule.nfc:
        hf.normalizer = normalizers.NFC()
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in rule.regexes]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_tokens(_added_tokens(tokens, types))
    return hf


def vocab_from_gguf_metadata(meta: dict) -> GGUFVocab:
    """The vocabulary llama.cpp's `tokenizer.ggml.*` keys describe. ValueError when a key is
    missing or of the wrong type, or a per-token list does not have one entry per token."""
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("this GGUF file has no vocabulary (tokenizer.ggml.tokens): pass tokenizer= "
                         "(a tokenizer.json, tokenizer.model or a model directory)")
    model = _field(meta, "tokenizer.ggml.model", "str")
    tokens = _field(meta, "tokenizer.ggml.tokens", "str list")
    n = len(tokens)
    if n == 0:
        raise ValueError("tokenizer metadata 'tokenizer.ggml.tokens' is empty")
    types = _field(meta, "tokenizer.ggml.token_type", "int list", [TOKEN_NORMAL] * n, length=n)
    _check_tokens(tokens, types, byte_level=model == "gpt2")

    if model == "llama":
        scores = _field(meta, "tokenizer.ggml.scores", "number list", [0.0] * n, length=n)
        unk_id = _special_id(meta, "unknown", n, 0)
        add_space_prefix = _field(meta, "tokenizer.ggml.add_space_prefix", "bool", True)
        hf = built(lambda: build_spm_tokenizer(tokens, scores, types, unk_id=unk_id, add_space_prefix=add_space_prefix),
                   "the GGUF vocabulary")
        bos_default, eos_default, add_bos_default, kind = 1, 2, True, "spm"
    elif model == "gpt2":
        pre = _field(meta, "tokenizer.ggml.pre", "str") or "default"
        merges = _merges(meta, tokens)
        hf = built(lambda: build_byte_level_tokenizer(tokens, merges, types, pre), "the GGUF vocabulary")
        unk_id = _special_id(meta, "unknown", n, None)
        bos_default, eos_default, kind = None, None, "byte_level"
        add_bos_default = PRE_TOKENIZER_RULES[pre].add_bos
    else:
        raise ValueError(f"unsupported tokenizer.ggml.model {model!r} (supported: 'llama', 'gpt2')")

    bos_id = _special_id(meta, "bos", n, bos_default)
    eos_id = _special_id(meta, "eos", n, eos_default)
    eos_ids = {i for i in (eos_id, _special_id(meta, "eot", n, None), _special_id(meta, "eom", n, None))
               if i is not None}
    eos_ids |= {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_CONTROL and t in END_OF_TURN_TEXTS}
    add_bos = _field(meta, "tokenizer.ggml.add_bos_token", "bool")
    add_eos = _field(meta, "tokenizer.ggml.add_eos_token", "bool", False)
    for flag, key, token in ((add_bos, "add_bos_token", bos_id), (add_eos, "add_eos_token", eos_id)):
        if flag and token is None:
            raise ValueError(f"tokenizer metadata 'tokenizer.ggml.{key}' is true, but the vocabulary has no "
                             f"{key[4:7].upper()} token")
    return GGUFVocab(
        hf=hf, bos_id=bos_id, eos_id=eos_id, eos_ids=eos_ids, unk_id=unk_id,
        pad_id=_special_id(meta, "padding", n, None),
        add_bos=(add_bos_default if add_bos is None else add_bos) and bos_id is not None,
        add_eos=add_eos, chat_template=_field(meta, "tokenizer.chat_template", "str"), kind=kind,
    )


def _merges(meta: dict, tokens: list[str]) -> list[str]:
    """tokenizer.ggml.merges: each two tokens of the vocabulary joined by a space, whose join is
    a token too (the tokenizers library panics on a merge it cannot resolve)."""
    merges = _field(meta, "tokenizer.ggml.merges", "str list")
    if merges is None:
        raise ValueError("a gpt2 vocabulary needs tokenizer.ggml.merges")
    known = set(tokens)
    for m in merges:
        parts = m.split(" ", 1)
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"tokenizer.ggml.merges holds {m!r}, not two tokens joined by a space")
        if not {*parts, "".join(parts)} <= known:
            raise ValueError(f"tokenizer.ggml.merges holds {m!r}: it or its parts are not in the vocabulary")
    return merges


def built(build, what: str):
    """build(); the `tokenizers` library reports a vocabulary it cannot use as a bare Exception
    (or, where its Rust code panics, a PanicException, which derives from BaseException), turned
    into a ValueError about `what` here."""
    try:
        return build()
    except ValueError:
        raise
    except BaseException as e:  # noqa: BLE001 - see above; anything else goes on as it is
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        raise ValueError(f"{what} cannot be built: {e}") from e
