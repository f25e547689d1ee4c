"""Reading a tokenizer (HF tokenizer.json or SentencePiece tokenizer.model) for the writers:
its size, the files an HF directory needs, and the vocabulary in GGUF's terms."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Side files an HF tokenizer directory may carry; config.json / generation_config.json are
# model files and are written fresh instead.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


@dataclass
class TokenizerInfo:
    directory: Path
    kind: str  # "bpe" (tokenizer.json, byte-level BPE) or "spm" (tokenizer.model)
    model_file: Path
    size: int  # number of token ids the tokenizer can produce
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    files: list[Path] = field(default_factory=list)
    unk_token_id: int | None = None

    def hf_files(self) -> list[Path]:
        return [p for p in self.files if p.exists()]


def load_tokenizer(path: str | Path) -> TokenizerInfo:
    """`path` is a tokenizer directory, a tokenizer.json or a tokenizer.model."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    if path.is_dir():
        if (path / "tokenizer.json").exists():
            path = path / "tokenizer.json"
        elif (path / "tokenizer.model").exists():
            path = path / "tokenizer.model"
        else:
            raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {directory}")
    if path.suffix == ".json":
        return _load_hf_json(directory, path)
    return _load_sentencepiece(directory, path)


def _load_hf_json(directory: Path, path: Path) -> TokenizerInfo:
    import gguf

    tok = json.loads(path.read_text(encoding="utf-8"))
    if tok["model"]["type"] != "BPE":
        raise ValueError(f"{path}: only BPE tokenizer.json is supported, got {tok['model']['type']}")
    ids = list(tok["model"]["vocab"].values()) + [a["id"] for a in tok.get("added_tokens", [])]
    size = max(ids) + 1
    special = gguf.SpecialVocab(directory, load_merges=False, n_vocab=size)
    sid = special.special_token_ids
    files = [path] + [directory / f for f in HF_TOKENIZER_FILES
                      if f not in ("tokenizer.json", "tokenizer.model")]
    return TokenizerInfo(directory, "bpe", path, size, sid.get("bos"), sid.get("eos"),
                         sid.get("pad"), files)


def _load_sentencepiece(directory: Path, path: Path) -> TokenizerInfo:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    pad = sp.pad_id()
    return TokenizerInfo(directory, "spm", path, sp.get_piece_size(), sp.bos_id(), sp.eos_id(),
                         pad if pad >= 0 else None, [path], sp.unk_id())


def hf_tokenizer_config_for_spm(info: TokenizerInfo) -> dict:
    """A tokenizer_config.json for a bare tokenizer.model, so AutoTokenizer knows the class."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(info.model_file))
    return {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
            "bos_token": sp.id_to_piece(sp.bos_id()), "eos_token": sp.id_to_piece(sp.eos_id()),
            "unk_token": sp.id_to_piece(sp.unk_id()), "legacy": True}


def detect_bpe_pre(tokenizer_json: dict) -> str:
    """llama.cpp's name for the pre-tokenizer (`tokenizer.ggml.pre`) of a known tokenizer.json.

    llama.cpp itself identifies it by hashing the token ids of a probe text; here the
    pre-tokenizer definition is recognised directly:
      * Split on a regex whose digit rule is \\p{N}{1,3}        -> "llama-bpe" (Llama 3)
      * that regex with single digits \\p{N} (+ NFC normalizer) -> "qwen2"
      * Digits(individual) followed by ByteLevel              -> "smollm"
      * a bare ByteLevel with its GPT-2 regex                  -> "gpt-2"
    """
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    split_regex = next((p["pattern"].get("Regex", "") for p in parts if p.get("type") == "Split"), "")
    if kinds == ["Split", "ByteLevel"] and re.search(r"\\p\{N\}\{1,3\}", split_regex):
        return "llama-bpe"
    if kinds == ["Split", "ByteLevel"] and re.search(r"\\p\{N\}\|", split_regex):
        return "qwen2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    raise ValueError("unrecognised pre-tokenizer; pass tokenizer_pre= with llama.cpp's name")


def add_vocab_to_gguf(writer, info: TokenizerInfo, n_vocab: int, pre: str | None = None) -> None:
    """Write the tokenizer.ggml.* keys: the vocabulary padded to n_vocab with unused
    "[PAD{i}]" tokens (as llama.cpp's converter does), its types, merges or scores, the
    special token ids, add_bos and the chat template."""
    import gguf

    if info.kind == "spm":
        tokens, scores, types = _spm_vocab(info)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
    else:
        tok = json.loads(info.model_file.read_text(encoding="utf-8"))
        tokens, types = _bpe_vocab(tok)
        scores = None
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre or detect_bpe_pre(tok))
    if n_vocab < len(tokens):
        raise ValueError(f"config vocab {n_vocab} < tokenizer's {len(tokens)}")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
        if scores is not None:
            scores.append(-1000.0)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if scores is not None:
        writer.add_token_scores(scores)
    special = gguf.SpecialVocab(info.directory, load_merges=info.kind == "bpe", n_vocab=n_vocab)
    if info.kind == "spm":
        # A SentencePiece model carries its own special ids; side files may not exist.
        special.special_token_ids.setdefault("bos", info.bos_token_id)
        special.special_token_ids.setdefault("eos", info.eos_token_id)
        special.special_token_ids.setdefault("unk", info.unk_token_id)
        special.add_special_token.setdefault("bos", True)
        special.add_special_token.setdefault("eos", False)
    special.add_to_gguf(writer, quiet=True)


def _bpe_vocab(tok: dict) -> tuple[list[str], list[int]]:
    by_id: dict[int, str] = {i: t for t, i in tok["model"]["vocab"].items()}
    kind: dict[int, int] = {i: NORMAL for i in by_id}
    for a in tok.get("added_tokens", []):
        by_id[a["id"]] = a["content"]
        kind[a["id"]] = CONTROL if a.get("special") else USER_DEFINED
    size = max(by_id) + 1
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [kind.get(i, UNUSED) for i in range(size)]
    return tokens, types


def _spm_vocab(info: TokenizerInfo) -> tuple[list[str], list[float], list[int]]:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(info.model_file))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(UNKNOWN)
        elif sp.is_control(i):
            types.append(CONTROL)
        elif sp.is_unused(i):
            types.append(UNUSED)
        elif sp.is_byte(i):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    return tokens, scores, types
