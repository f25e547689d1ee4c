"""Perplexity of one model's weights stored in several dtypes (rung 7 of the testing ladder).

usage: python evals/requantized_perplexity.py [MODEL.gguf] [--tokenizer DIR] [--dtypes f32 q8_0 ...]
       [--kv-dtype f32] [--threads 2] [--out results.json]

The GGUF is dequantized to float32 and re-quantized to each dtype with the project's own
writer (python -m ferrum.tools.make_model's from_dequantized), then each file's perplexity on
the GPL-3 preamble (512-token windows, stride 256) is printed next to the f32 copy's. Needs the
tools extra (gguf). Takes a few minutes for a 135M model on 2 cores.
"""
import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

GPL3 = "/usr/share/common-licenses/GPL-3"
SMOLLM2_TOKENIZER = os.path.join(HERE, "..", "..", "shared", "models", "tokenizers", "smollm2-135m-instruct")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="a GGUF (default: the default model)")
    ap.add_argument("--tokenizer", default=SMOLLM2_TOKENIZER,
                    help="tokenizer the written files embed (default: SmolLM2's, from ../shared)")
    ap.add_argument("--dtypes", nargs="+", default=["f32", "q8_0", "q6_k", "q4_k_m", "q4_0"])
    ap.add_argument("--kv-dtype", default="f32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the figures as JSON")
    a = ap.parse_args()

    import ferrum
    from ferrum.eval import perplexity
    from ferrum.models import resolve_model
    from ferrum.tools.gguf_weights import read_gguf_model
    from ferrum.tools.make_model import from_dequantized

    source = resolve_model(a.model)
    text = open(GPL3, encoding="utf-8").read()
    preamble = text[:text.index("TERMS AND CONDITIONS")]
    config, weights = read_gguf_model(source)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in [("original", str(source))] + [(d, None) for d in a.dtypes]:
            if path is None:
                path = str(from_dequantized(weights, config, format="gguf", dtype=name,
                                            out=os.path.join(tmp, f"{name}.gguf"), tokenizer=a.tokenizer))
            t0 = time.perf_counter()
            llm = ferrum.LLM(path, kv_dtype=a.kv_dtype, num_threads=a.threads)
            r = perplexity(llm, preamble, window=512, stride=256)
            rows.append({"weights": name, "file_mib": round(os.path.getsize(path) / 2**20, 1),
                         "perplexity": round(r.perplexity, 4), "tokens": r.num_tokens,
                         "seconds": round(time.perf_counter() - t0, 1)})
            print(rows[-1], flush=True)
            del llm
    base = next((r["perplexity"] for r in rows if r["weights"] == "f32"), None)
    print(f"\n{source.name}, KV {a.kv_dtype}, GPL-3 preamble, window 512 stride 256")
    print("| weights | file (MiB) | perplexity | vs f32 |\n|---|---|---|---|")
    for r in rows:
        rel = f"{100 * (r['perplexity'] / base - 1):+.2f}%" if base else "—"
        print(f"| {r['weights']} | {r['file_mib']} | {r['perplexity']:.3f} | {rel} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": source.name, "kv_dtype": a.kv_dtype, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
