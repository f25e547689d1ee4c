"""The installed wheel at work: `import ferrum` from site-packages, a greedy generation with
stories260K equal to its reference, and, where OpenCL is hidden, the clear error for
device="opencl"; with --model, also the greedy token ids of a short generation with that model
(printed, for scripts/check_wheel.sh to compare across CPUs). Run by check_wheel.sh in the wheel's
own venv, outside the repository.

usage: python wheel_smoke.py STORIES260K_DIR [--no-opencl] [--model GGUF]
"""
import argparse
import json
import os

import ferrum
from ferrum import _core

ap = argparse.ArgumentParser()
ap.add_argument("stories")
ap.add_argument("--no-opencl", action="store_true")
ap.add_argument("--model")
a = ap.parse_args()
stories = os.path.join(a.stories, "stories260K.gguf")
assert "site-packages" in ferrum.__file__, f"ferrum imported from {ferrum.__file__}, not the wheel"

ref = json.load(open(os.path.join(a.stories, "reference.json")))
expect = ref["greedy_after_prompt"]["generated_ids"]
params = ferrum.SamplingParams(max_tokens=len(expect), temperature=0, ignore_eos=True)
out = ferrum.LLM(stories, kv_dtype="f32").generate(ref["prompt_encoding"]["prompt"], params)[0]
assert out.outputs[0].token_ids == expect, out.outputs[0].token_ids
print(f"[smoke] stories260K greedy continuation matches its reference (cpu features: {_core.cpu_features()})")

if a.no_opencl:
    try:
        ferrum.LLM(stories, device="opencl")
    except ValueError as e:
        assert "OpenCL is not available" in str(e), e
        print(f"[smoke] device='opencl' without OpenCL: ValueError: {e}")
    else:
        raise AssertionError("device='opencl' worked with the OpenCL loader hidden")

if a.model:
    greedy = ferrum.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = ferrum.LLM(a.model).generate("The capital of France is", greedy)[0].outputs[0].token_ids
    print(f"[smoke] {os.path.basename(a.model)} greedy ids: {ids}")
