"""The installed wheel at work: `import ferrum` from site-packages, a greedy generation with
stories260K equal to its reference, and, where OpenCL is hidden, the clear error for
device="opencl". Run by scripts/check_wheel.sh in the wheel's own venv, outside the repository.

usage: python wheel_smoke.py STORIES260K_DIR [--no-opencl]
"""
import json
import os
import sys

import ferrum
from ferrum import _core

stories = sys.argv[1]
model = os.path.join(stories, "stories260K.gguf")
assert "site-packages" in ferrum.__file__, f"ferrum imported from {ferrum.__file__}, not the wheel"

ref = json.load(open(os.path.join(stories, "reference.json")))
expect = ref["greedy_after_prompt"]["generated_ids"]
params = ferrum.SamplingParams(max_tokens=len(expect), temperature=0, ignore_eos=True)
out = ferrum.LLM(model, kv_dtype="f32").generate(ref["prompt_encoding"]["prompt"], params)[0]
assert out.outputs[0].token_ids == expect, out.outputs[0].token_ids
print(f"[smoke] stories260K greedy continuation matches its reference (cpu features: {_core.cpu_features()})")

if "--no-opencl" in sys.argv:
    try:
        ferrum.LLM(model, device="opencl")
    except ValueError as e:
        assert "OpenCL is not available" in str(e), e
        print(f"[smoke] device='opencl' without OpenCL: ValueError: {e}")
    else:
        raise AssertionError("device='opencl' worked with the OpenCL loader hidden")
