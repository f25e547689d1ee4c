"""Structured output (SamplingParams(structured_outputs=...), llguidance): constrained outputs
always parse, greedy or sampled, batched with unconstrained requests (whose outputs do not
change), with speculative decoding; bad constraints are a ValueError."""
import json
import re

import jsonschema
import pytest

import ferrum
from conftest import STORIES_FORMATS
from ferrum.structured import MASK_COST, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}


def constrained(n=1, temperature=0.0, seed=None, max_tokens=96, **constraint):
    return ferrum.SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def chat_prompt(smollm2):
    def render(text):
        return smollm2.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return render


def texts(outputs):
    return [c.text for o in outputs for c in o.outputs]


def test_json_schema_outputs_validate_greedy_and_sampled(smollm2, chat_prompt):
    prompts = [chat_prompt("Describe a person as JSON."), chat_prompt("Who lives in Rome? Answer in JSON."),
               "Here is a record:"]
    outs = smollm2.generate(prompts, constrained(json=PERSON)) + smollm2.generate(
        prompts, constrained(json=PERSON, n=3, temperature=1.0, seed=7))
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text  # ended by the grammar, not by max_tokens
            jsonschema.validate(json.loads(c.text), PERSON)


def test_regex_choice_lark_and_gbnf(smollm2, chat_prompt):
    prompt = chat_prompt("Give me a phone number.")
    for text in texts(smollm2.generate([prompt], constrained(regex=r"\(\d{3}\) \d{3}-\d{4}", n=2, temperature=0.8, seed=1))):
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text)
    colors = ["red", "green", "blue"]
    for text in texts(smollm2.generate([chat_prompt("Name a color.")], constrained(choice=colors, n=3, temperature=1.0, seed=2))):
        assert text in colors
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/'
    for text in texts(smollm2.generate([chat_prompt("What is 6 times 7?")], constrained(grammar=lark))):
        assert re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", text)
    gbnf = 'root ::= "yes" | "no" | "maybe"'
    for text in texts(smollm2.generate([chat_prompt("Is the sky blue?")], constrained(grammar=gbnf, n=2, temperature=1.0, seed=3))):
        assert text in ("yes", "no", "maybe")


def test_json_object_is_any_object(smollm2, chat_prompt):
    question = 'Reply with a JSON object with the key "answer": what is 2+2?'
    out = smollm2.generate([chat_prompt(question)], constrained(json_object=True, max_tokens=200))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(smollm2, chat_prompt):
    free = ferrum.SamplingParams(max_tokens=24, temperature=0)
    assert free.plain_greedy and not constrained(json=PERSON).plain_greedy  # the sampler's fast path stays
    prompts = [chat_prompt("Tell me a joke."), chat_prompt("What is the capital of Italy?")]
    alone = texts(smollm2.generate(prompts, free))
    steps = MASK_COST.snapshot()["steps"]
    mixed = smollm2.generate(prompts + [chat_prompt("A person in JSON:")], [free, free, constrained(json=PERSON)])
    assert texts(mixed[:2]) == alone
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), PERSON)
    assert MASK_COST.snapshot()["steps"] > steps  # each constrained step's mask is measured


def test_a_complete_grammar_ends_the_completion_even_with_ignore_eos(smollm2, chat_prompt):
    params = constrained(json={"type": "boolean"}, max_tokens=60)  # complete after `true` or `false`
    params.ignore_eos = True
    for prompt in [chat_prompt("Is water wet? Answer in JSON."), "true"]:
        c = smollm2.generate([prompt], params)[0].outputs[0]
        assert c.finish_reason == "stop" and json.loads(c.text) in (True, False), c.text


def test_a_tiny_model_still_produces_valid_json():
    """stories260K knows no JSON: the mask alone makes its output parse."""
    llm = ferrum.LLM(STORIES_FORMATS["gguf"], num_threads=2, max_model_len=512)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    params = constrained(json=schema, disable_any_whitespace=True, n=4, temperature=1.0, seed=5, max_tokens=200)
    for o in llm.generate(["Once upon a time"], params):
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), schema)


def test_speculative_decoding_keeps_outputs_and_constraints(smollm2_path, smollm2, chat_prompt):
    spec = ferrum.LLM(smollm2_path, num_threads=2, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    prompts = [chat_prompt("Repeat as JSON: name Ada, age 36, city Oslo, tags math, code."),
               chat_prompt("A person as JSON, please.")]
    params = constrained(json=PERSON)
    got = texts(spec.generate(prompts, params))
    assert got == texts(smollm2.generate(prompts, params))  # greedy: token for token
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)
    assert spec.stats()["spec_proposed_tokens"] > 0


@pytest.mark.parametrize("bad", [
    {}, {"json": PERSON, "regex": "a+"}, {"json": 5}, {"regex": ""}, {"regex": "(unclosed"},
    {"choice": []}, {"choice": ["a", 3]}, {"grammar": "start: undefined_rule"},
    {"json": "{not json"}, {"json_object": "yes"},
])
def test_bad_constraints_are_value_errors(bad):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**bad)


def test_structured_outputs_must_be_the_params_type():
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        ferrum.SamplingParams(structured_outputs={"json": PERSON})


def test_a_greedy_row_takes_the_masked_argmax_whether_or_not_the_grammar_allows_its_own(smollm2):
    """The greedy shortcut (the row's own argmax when the grammar allows it, one token checked)
    picks what the whole mask's argmax picks, on rows whose own argmax is allowed and on rows
    where it is not; a sampler batch of such rows matches too."""
    import numpy as np
    from ferrum.sampling import Sampler, SamplingState
    from ferrum.structured import GrammarConstraint

    tok, vocab = smollm2.tokenizer, smollm2.tokenizer.vocab_size
    params = constrained(json=PERSON)
    rng = np.random.default_rng(0)
    shortcut, masked = GrammarConstraint(params.structured_outputs, tok, vocab), \
        GrammarConstraint(params.structured_outputs, tok, vocab)
    ids, own_allowed = [], []
    while len(ids) < 60:
        logits = rng.standard_normal(vocab).astype(np.float32)
        row = logits.astype(np.float64)
        masked.apply(row, ids)
        allowed = np.flatnonzero(np.isfinite(row))
        if rng.random() < 0.5:  # make an allowed token the row's own argmax
            logits[rng.choice(allowed)] = logits.max() + 1.0
            row = logits.astype(np.float64)
            masked.apply(row, ids)
        want = int(np.argmax(row))
        top = int(np.argmax(logits))
        own_allowed.append(top == want)
        assert shortcut.greedy(logits, top, ids) == want
        if want in tok.eos_token_ids:
            break
        ids.append(want)
    assert any(own_allowed) and not all(own_allowed)

    states = [SamplingState(params, constraint=GrammarConstraint(params.structured_outputs, tok, vocab))
              for _ in range(3)] + [SamplingState(ferrum.SamplingParams(temperature=0.0))]
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    work = Sampler().process_logits(logits, [SamplingState(s.params, constraint=GrammarConstraint(
        params.structured_outputs, tok, vocab) if s.constraint else None) for s in states])
    assert list(Sampler().sample(logits, states).token_ids) == list(np.argmax(work, axis=1))
