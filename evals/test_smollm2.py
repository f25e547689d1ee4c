"""An example evaluation suite for SmolLM2-135M-Instruct, run with the ferrum pytest plugin:

    pytest evals/                                   # the default model
    pytest evals/ --ferrum-model path/to/SmolLM2-135M-Instruct.Q4_1.gguf --ferrum-threads 2

The thresholds are this model's: another model gets other figures.
"""
import pytest

# The preamble of the GPL version 3: fixed English prose that every Debian machine has.
GPL3 = "/usr/share/common-licenses/GPL-3"

# Perplexity of the preamble (789 tokens) with 512-token windows moved 256 at a time, measured
# with ferrum: 20.03 (f16 or f32 KV cache), 20.09 (int8 KV); transformers on the same GGUF
# agrees to 1e-7 (tests/test_eval.py). The bound is 10% above: room for other thread counts
# and summation orders, while a change that costs the model real quality fails it.
PREAMBLE_PPL_MAX = 22.0

# Few-shot questions whose greedy answers the model gets right (checked one by one).
SHOTS = "Q: What is the capital of Spain?\nA: Madrid\nQ: What is 3 + 5?\nA: 8\nQ: What color is grass?\nA: green\n"
QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is 2 + 2?", "4"),
    ("How many legs does a spider have?", "8"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("Who wrote Romeo and Juliet?", ["William Shakespeare", "Shakespeare"]),
    ("What language is spoken in Spain?", "Spanish"),
]


def gpl3_preamble():
    text = open(GPL3, encoding="utf-8").read()
    return text[:text.index("TERMS AND CONDITIONS")]


def test_perplexity_of_english_prose(perplexity):
    result = perplexity(gpl3_preamble(), window=512, stride=256)
    assert result.num_tokens > 700
    assert result.perplexity < PREAMBLE_PPL_MAX, result


@pytest.fixture(scope="module")
def answers(exact_match):
    # One call: every question is generated in the same batch.
    return exact_match([(SHOTS + f"Q: {q}\nA:", a) for q, a in QUESTIONS], max_tokens=8)


@pytest.mark.parametrize("index", range(len(QUESTIONS)), ids=[q for q, _ in QUESTIONS])
def test_greedy_answer(answers, index):
    item = answers.items[index]
    assert item.correct, f"{QUESTIONS[index][0]!r}: got {item.output!r}, expected {item.expected}"


def test_continuation_likelihood_ranks_the_fact_first(loglikelihood):
    context = "The capital of France is"
    scores = loglikelihood([(context, " Paris"), (context, " London"), (context, " Berlin")])
    assert scores[0].is_greedy
    assert scores[0].logprob > max(s.logprob for s in scores[1:])
