"""Chat templates render byte for byte like transformers' apply_chat_template."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from ferrum.chat_template import apply_chat_template
from ferrum.tokenizer import Tokenizer
from gguf_meta import read_gguf_metadata

TOK = Path("/work/shared/models/tokenizers")
if not TOK.is_dir():
    TOK = Path(__file__).resolve().parents[2] / "shared" / "models" / "tokenizers"

SYSTEM = {"role": "system", "content": "You are terse. Use <b>bold</b> & \"quotes\"."}
USER = {"role": "user", "content": "Hi! What's 2+2? 你好 🎉"}
ASSISTANT = {"role": "assistant", "content": "4.\n\nAnything else?"}
USER2 = {"role": "user", "content": "  spaces around  \n"}
THINKING_REPLY = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."}

CONVERSATIONS = {
    "single": [USER],
    "system": [SYSTEM, USER],
    "multi_turn": [SYSTEM, USER, ASSISTANT, USER2],
    "ends_with_assistant": [USER, ASSISTANT],
    "reasoning_history": [USER, THINKING_REPLY, USER2],
}


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(TOK / "qwen3-0.6b"), AutoTokenizer.from_pretrained(str(TOK / "qwen3-0.6b"))


@pytest.fixture(scope="module")
def llama3():
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(TOK / "llama3"), AutoTokenizer.from_pretrained(str(TOK / "llama3"))


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    """The SmolLM2-135M-Instruct GGUF's tokenizer (its embedded template) and transformers' tokenizer
    from the matching tokenizer.json, which has no template of its own, rendering that same template."""
    from transformers import AutoTokenizer

    meta = read_gguf_metadata(smollm2_path)
    ref = AutoTokenizer.from_pretrained(str(TOK / "smollm2-135m-instruct"))
    return Tokenizer.from_gguf_metadata(meta), ref


def _reference(ref, messages, template=None, **kwargs):
    return ref.apply_chat_template(messages, tokenize=False, chat_template=template, **kwargs)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_qwen3_template_matches_transformers(qwen3, conversation, add_generation_prompt, extra):
    ours, ref = qwen3
    messages = CONVERSATIONS[conversation]
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    assert got == _reference(ref, messages, add_generation_prompt=add_generation_prompt, **extra)


def test_qwen3_template_with_tools_matches_transformers(qwen3):
    ours, ref = qwen3
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather <now> & later",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    got = ours.apply_chat_template([SYSTEM, USER], tools=tools)
    assert got == _reference(ref, [SYSTEM, USER], tools=tools, add_generation_prompt=True)
    assert "Weather <now> & later" in got  # tojson must not HTML-escape


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_gguf_template_matches_transformers(smollm2, conversation, add_generation_prompt):
    ours, ref = smollm2
    assert ours.chat_template and "<|im_start|>" in ours.chat_template
    messages = CONVERSATIONS[conversation]
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == _reference(ref, messages, ours.chat_template, add_generation_prompt=add_generation_prompt)


def test_smollm2_chat_prompt_tokenizes_like_transformers(smollm2):
    ours, ref = smollm2
    text = ours.apply_chat_template(CONVERSATIONS["multi_turn"])
    assert ours.apply_chat_template(CONVERSATIONS["multi_turn"], tokenize=True) == \
        ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_llama3_template_matches_transformers_and_has_one_bos(llama3, conversation):
    ours, ref = llama3
    messages = CONVERSATIONS[conversation]
    text = ours.apply_chat_template(messages)
    assert text == _reference(ref, messages, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|>")
    ids = ours.apply_chat_template(messages, tokenize=True)
    assert ids[0] == 128000 and ids.count(128000) == 1
    assert ours.encode(text).count(128000) == 1


def test_missing_template_is_a_clear_error():
    tok = Tokenizer.from_file(TOK / "llama2" / "tokenizer.model")
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([USER])
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(None, [USER])


def test_environment_features():
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if m.role == 'skip' %}{% continue %}{% endif %}{{ m | tojson }}|{% endfor %}"
        "{{ bos_token }}{{ eos_token }}{{ custom }}{{ strftime_now('%Y') | length }}"
        "{% generation %}gen{% endgeneration %}")
    messages = [{"role": "skip"}, {"role": "u", "content": "<&>"}, {"role": "third"}]
    got = apply_chat_template(template, messages, bos_token="<s>", eos_token="</s>", custom="!")
    assert got == '{"role": "u", "content": "<&>"}|<s></s>!4gen'
    # A missing special token renders as empty, as in transformers, not as "None".
    assert apply_chat_template("[{{ bos_token }}]", [], bos_token=None) == "[]"
    with pytest.raises(jinja2.TemplateError, match="nope"):
        apply_chat_template("{{ raise_exception('nope') }}", [USER])


def test_template_is_sandboxed():
    with pytest.raises(jinja2.exceptions.SecurityError):
        apply_chat_template("{{ messages.__class__.__mro__ }}{% set x = messages.append(1) %}", [USER])
