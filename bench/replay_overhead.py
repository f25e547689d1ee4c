"""Per-token host overhead of a decode step, eager vs replayed.

usage: python bench/replay_overhead.py [MODEL] [-n 200] [-t 2]

Eager execution records the step's op list afresh every token (then runs it); replay records it
once per shape and only rewrites the input buffers. On a tiny model (stories260K by default:
the arithmetic is negligible) the difference between the two per-token times is the host work
that replay removes, and the replayed time bounds what is left (buffer writes, the runner's
bookkeeping, the pybind11 call, logits copy-out).
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STORIES = os.path.join(HERE, "..", "..", "shared", "models", "stories260K", "stories260K.gguf")


def per_token_us(runner, n: int, replay: bool) -> float:
    """Median time of one single-token decode step, in microseconds."""
    runner.set_replay(replay)
    seq = runner.add_sequence()
    tok = int(runner.step([(seq, [1], "last")])[0].argmax())
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        tok = int(runner.step([(seq, [tok], "last")])[0].argmax())
        times.append(time.perf_counter() - t0)
    runner.release_sequence(seq)
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=STORIES)
    ap.add_argument("-n", type=int, default=200, help="decode steps per measurement")
    ap.add_argument("-t", type=int, default=2, help="threads")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from ferrum import _core
    runner = _core.ModelRunner(a.model, num_threads=a.t, max_model_len=2 * a.n + 64,
                               kv_cache_tokens=2 * a.n + 64, prefix_cache=False)
    eager = min(per_token_us(runner, a.n, False) for _ in range(3))
    replay = min(per_token_us(runner, a.n, True) for _ in range(3))
    res = {"model": os.path.basename(a.model), "threads": a.t, "eager_us_per_token": round(eager, 1),
           "replay_us_per_token": round(replay, 1), "saved_us_per_token": round(eager - replay, 1)}
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{res['model']}  threads {a.t}: eager {eager:.1f} us/token, replay {replay:.1f} us/token "
              f"(replay saves {eager - replay:.1f} us, {100 * (1 - replay / eager):.0f}%)")


if __name__ == "__main__":
    sys.exit(main())
