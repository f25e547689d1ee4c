"""Tool-call and reasoning parsing on replies as the models write them: each format's calls,
parallel calls, text around them, malformed and cut-off calls (which stay text), and the
streamed split joining to the whole one however the text is cut into pieces."""
import json
import random

import pytest
from conftest import MODELS

from ferrum.server.reply import REASONING_FORMATS, ReplySplitter, detect_reasoning
from ferrum.server.tool_calls import FORMATS, ToolCall, detect_format

NAMES = ["get_weather", "add"]


def call(name, **args):
    return ToolCall(name, json.dumps(args))


# (format, reply text, expected text outside the calls, expected calls)
FIXTURES = [
    # Qwen2.5 / Qwen3 / Hermes
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [call("get_weather", city="Paris")]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check.\n\n", [call("get_weather", city="Paris"), call("add", a=1, b=2)]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", [call("add", a=1)]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "", [call("add", a=1)]),  # EOS, no close
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1', None, []),  # cut off
    ("hermes", '<tool_call>\n{"name": "add" "arguments": {}}\n</tool_call>', None, []),  # bad JSON
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', None, []),  # no name
    ("hermes", '<tool_call>\n[1, 2]\n</tool_call> and <tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
     '<tool_call>\n[1, 2]\n</tool_call> and ', [call("add")]),  # one malformed, one good
    ("hermes", "No tools needed: 4.", None, []),
    # Llama 3.1 / 3.2 / 3.3 JSON
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [call("get_weather", city="Paris")]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3}}',
     "", [call("add", a=1, b=2), call("add", a=3)]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} trailing words', None, []),
    ("llama3_json", '{"name": "add", "parameters": {"a": ', None, []),
    ("llama3_json", 'The answer is {"x": 1}.', None, []),
    # Mistral: v3 JSON list, v11 name[ARGS]{...}
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1}}]',
     "", [call("get_weather", city="Paris"), call("add", a=1)]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 2}',
     "Sure. ", [call("get_weather", city="Paris"), call("add", a=2)]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}', None, []),
    ("mistral", '[TOOL_CALLS][]', None, []),
    # Pythonic (Llama 3.2 / 4)
    ("pythonic", '[get_weather(city="Paris"), add(a=1, b=2)]', "", [call("get_weather", city="Paris"), call("add", a=1, b=2)]),
    ("pythonic", 'I will call it: [add(a=1, b=true, c=None, d=[1, {"k": "v"}])]', "I will call it: ",
     [call("add", a=1, b=True, c=None, d=[1, {"k": "v"}])]),
    ("pythonic", '[add(1, 2)]', None, []),  # positional arguments
    ("pythonic", '[add(a=os.system("x"))]', None, []),  # not a literal
    ("pythonic", '[add(a=1', None, []),
    ("pythonic", 'a list [1, 2] of numbers', None, []),
]


@pytest.mark.parametrize("fmt,text,content,calls", FIXTURES)
def test_each_format_parses_its_calls_and_leaves_malformed_ones_as_text(fmt, text, content, calls):
    got_content, got_calls = FORMATS[fmt].parse(text, NAMES)
    assert got_calls == calls
    assert got_content == (text if content is None else content)
    for c in got_calls:
        assert isinstance(json.loads(c.arguments), dict)


def pieces(text, rng):
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 7])
        out.append(text[i:i + n])
        i += n
    return out


def joined(splitter, parts):
    stream = splitter.stream()
    sent = {"reasoning": "", "content": ""}
    for p in parts:
        for d in stream.feed(p):
            for k, v in d.items():
                if k != "reasoning_content":
                    sent[k] += v
    final, message = stream.finish()
    for d in final:
        for k, v in d.items():
            if k != "reasoning_content":
                sent[k] += v
    return sent, message


REASONED = [
    ("open", "<think>\nThe user wants the weather.\n</think>\n\nI'll check.\n"
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("open", "<think>\nthinking </thi still thinking\n</think>\n\nThe answer is 4."),
    ("open", "<think>\nnever ends"),
    ("open", "Just text, <tool_ no call."),
    ("inside", "reasoning from the start</think>The answer."),
    ("open", '<tool_call>\n{"name": "add", "arguments": {"a": 1'),  # cut off: text
]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_streamed_split_joins_to_the_whole_split(fmt):
    rng = random.Random(0)
    tool = FORMATS[fmt]
    texts = [("open", text) for f, text, _, _ in FIXTURES if f == fmt] + REASONED
    for state, text in texts:
        for reasoning in (None, REASONING_FORMATS["qwen3"]):
            split = ReplySplitter(reasoning, state == "inside", tool, tool.triggers_for(NAMES), NAMES)
            whole = split.whole(text)
            for _ in range(5):
                sent, message = joined(split, pieces(text, rng))
                assert message == whole
                assert sent["content"] == (whole.content or "")
                assert sent["reasoning"] == (whole.reasoning or "")


def test_reasoning_then_a_call():
    split = ReplySplitter(REASONING_FORMATS["qwen3"], False, FORMATS["hermes"], ["<tool_call>"], NAMES)
    m = split.whole(REASONED[0][1])
    assert m.reasoning == "The user wants the weather."
    assert m.content == "I'll check."
    assert m.tool_calls == [call("get_weather", city="Paris")]
    m = split.whole("<think>\nhmm\n</think>\n\n" + FIXTURES[0][1])
    assert (m.reasoning, m.content, m.tool_calls) == ("hmm", None, [call("get_weather", city="Paris")])


def test_formats_and_reasoning_detected_from_templates():
    with open(f"{MODELS}/tokenizers/qwen3-0.6b/tokenizer_config.json") as f:
        qwen3_template = json.load(f)["chat_template"]
    assert detect_format(qwen3_template).name == "hermes"
    assert detect_reasoning(qwen3_template) is not None
    assert detect_format("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert detect_format("<|start_header_id|>ipython<|end_header_id|> <|python_tag|>").name == "llama3_json"
    assert detect_format("[func_name1(params_name1=params_value1)]").name == "pythonic"
    assert detect_format("{{ messages }}") is None and detect_reasoning("{{ messages }}") is None


SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"]},
    "add": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                             "b": {"type": "boolean"}}, "required": ["a"]},
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in SCHEMAS.items()]


_WALKS = {}


def grammar_walks(fmt):
    """Replies as token pieces: random walks through the format's grammar for the tools (any
    allowed token, uniformly), made once per format."""
    if fmt in _WALKS:
        return _WALKS[fmt]
    import llguidance
    import numpy as np
    from ferrum.server.chat_tools import plan_tools
    from ferrum.structured import llguidance_tokenizer
    from ferrum.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(f"{MODELS}/tokenizers/qwen3-0.6b")
    lt = llguidance_tokenizer(tok)
    grammar = plan_tools(TOOLS, "required", True, FORMATS[fmt], tok, None, "closed").constraint.llguidance_grammar()
    rng = np.random.default_rng(0)
    mask = np.zeros((lt.vocab_size + 31) // 32, dtype=np.int32)
    walks = []
    for walk in range(12):
        matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
        ids = []
        while not matcher.is_stopped():
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:lt.vocab_size])
            token = int(rng.choice(allowed))
            if token in tok.eos_token_ids:
                break
            assert matcher.consume_token(token), matcher.get_error()
            ids.append(token)
            assert len(ids) < 400, tok.decode(ids, skip_special_tokens=False)
        texts = [tok.decode(ids[:k], skip_special_tokens=False) for k in range(len(ids) + 1)]
        walks.append([b[len(a):] for a, b in zip(texts, texts[1:])])
    _WALKS[fmt] = walks
    return walks


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_formats_grammar_writes_calls_its_parser_reads(fmt):
    """What the grammar writes, the format's parser reads back as calls of the tools, with
    arguments that match their schemas."""
    import jsonschema
    tool = FORMATS[fmt]
    for pieces_ in grammar_walks(fmt):
        text = "".join(pieces_)
        content, calls = tool.parse(text, list(SCHEMAS))
        assert calls and content.strip() == "", text
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_held_calls_stream_their_name_then_their_arguments_as_written(fmt):
    """Fed token by token, calls the grammar wrote stream as OpenAI streams them: a call's id and
    name first, then its arguments in pieces while it is written, joining to the parser's calls;
    and at every token the calls begun so far extend those before (so a reply cut anywhere is
    the stream's prefix)."""
    tool = FORMATS[fmt]
    split = ReplySplitter(None, False, tool, tool.triggers_for(NAMES), NAMES, held_calls=True)
    for pieces_ in grammar_walks(fmt):
        text = "".join(pieces_)
        _, parsed = tool.parse(text, NAMES)
        stream, calls, before, written = split.stream(), {}, [], ""
        arguments_during = cut_in_a_call = 0
        for piece in pieces_:
            assert stream.feed(piece) == []  # no text outside the calls
            written += piece
            for d in stream.call_deltas():
                (t,) = d["tool_calls"]
                entry = calls.setdefault(t["index"], {"name": None, "arguments": ""})
                if "id" in t:
                    assert entry["name"] is None and t["function"]["arguments"] == ""
                    entry["name"] = t["function"]["name"]
                else:
                    assert entry["name"] is not None
                    entry["arguments"] += t["function"]["arguments"]
                    arguments_during += written != text
            cut = split.whole(written)
            now = cut.tool_calls
            cut_in_a_call += bool(now) and not cut.calls_complete
            assert len(now) >= len(before)
            assert all(n.name == b.name and n.arguments.startswith(b.arguments) for n, b in zip(now, before))
            before = now
        final, message = stream.finish()
        assert final == [] and message.calls_complete
        for d in stream.finish_calls(message):
            calls[d["tool_calls"][0]["index"]]["arguments"] += d["tool_calls"][0]["function"]["arguments"]
        assert message.tool_calls == parsed and message.content is None
        assert [ToolCall(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == parsed
        assert arguments_during > 0  # pieces of arguments came before the reply's end
        assert cut_in_a_call > 0  # a reply cut inside a call has it begun, not complete


def test_a_forced_call_may_follow_the_reasoning():
    import llguidance
    from ferrum.server.chat_tools import plan_tools
    from ferrum.structured import llguidance_tokenizer
    from ferrum.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(f"{MODELS}/tokenizers/qwen3-0.6b")
    think = REASONING_FORMATS["qwen3"]
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'

    def accepts(state, text):
        grammar = plan_tools(TOOLS, "required", False, FORMATS["hermes"], tok, think, state).constraint
        m = llguidance.LLMatcher(llguidance_tokenizer(tok), grammar.llguidance_grammar(), log_level=0)
        return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()
    assert accepts("open", "<think>\nLet me add: 3 </ok\n</think>\n\n" + call_text)
    assert accepts("open", call_text) and accepts("closed", call_text)
    assert not accepts("closed", "<think>\nhm\n</think>\n\n" + call_text)
    assert accepts("inside", "Let me add.\n</think>\n\n" + call_text)
    assert not accepts("inside", call_text)
