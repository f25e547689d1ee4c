"""llama.cpp's logits for a prompt, optionally with a GGUF LoRA adapter: `scores(...)` runs this
file under llama-cpp-python's interpreter (the peer that ../shared/bench/llamacpp/run.sh installs
on first use), with f32 KV so that only the engines' arithmetic differs.

    python llamacpp_scores.py MODEL.gguf OUT.npy '[ids]' [ADAPTER.gguf]
"""
import json
import os
import subprocess
import sys
import tempfile

GGML_TYPE_F32 = 0


def scores(model, prompt, adapter=None):
    """llama.cpp's logits [len(prompt), vocab] (f32) for the token ids `prompt`."""
    import numpy as np
    from conftest import SHARED
    run = os.path.join(SHARED, "bench", "llamacpp", "run.sh")
    # run.sh installs the peer on first use (and runs it once, briefly, on the model)
    install = subprocess.run(["bash", run, str(model), "1", "1", "2"], capture_output=True, text=True, timeout=1800)
    assert install.returncode == 0, install.stderr[-2000:]
    peer = os.path.join(os.environ.get("FERRUM_PEER_DIR", os.path.expanduser("~/.cache/ferrum-peer/llama-cpp-python")),
                        "venv", "bin", "python")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "scores.npy")
        cmd = [peer, __file__, str(model), out, json.dumps([int(t) for t in prompt])]
        proc = subprocess.run(cmd + ([str(adapter)] if adapter else []), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return np.load(out)


def main():
    import numpy as np
    from llama_cpp import Llama
    model, out, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    lora = {"lora_path": sys.argv[4]} if len(sys.argv) > 4 else {}
    llm = Llama(model_path=model, n_ctx=max(256, len(prompt)), n_batch=512, n_threads=2, n_threads_batch=2,
                logits_all=True, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False, **lora)
    llm.eval(prompt)
    np.save(out, np.asarray(llm.scores[:len(prompt)], dtype=np.float32))


if __name__ == "__main__":
    main()
