"""Render a model's jinja2 chat template the way Hugging Face transformers does.

Same environment as transformers (sandboxed, trim_blocks + lstrip_blocks, loop controls, a
`tojson` that does not HTML-escape, `raise_exception`, `strftime_now`), so the prompt text is
byte-for-byte what the model was trained on.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's built-in tojson HTML-escapes '<', '>', '&' and "'", which templates must not see.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def apply_chat_template(template: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, bos_token: str | None = None,
                        eos_token: str | None = None, tools: list[dict] | None = None,
                        documents: list[dict] | None = None, **kwargs) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) into the prompt string.

    continue_final_message: end the prompt right after the last message's content (no end of
    turn), so that a reply continues it; exclusive with add_generation_prompt, as in transformers.
    Extra keyword arguments (e.g. enable_thinking=False) are passed to the template as variables.
    """
    if not template:
        raise ValueError("this model has no chat template; pass a template string or format the prompt yourself")
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise TypeError("messages must be a list of dicts like {'role': 'user', 'content': '...'}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message continues the last message, add_generation_prompt opens a new "
                         "one: pass add_generation_prompt=False with continue_final_message=True")
    # Like transformers, a token the model lacks is left undefined (renders as ""), not passed as None.
    special = {name: tok for name, tok in (("bos_token", bos_token), ("eos_token", eos_token)) if tok is not None}
    text = compile_chat_template(template).render(
        messages=list(messages), tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
        **{**special, **kwargs})
    return _cut_after_final_message(text, messages) if continue_final_message else text


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """`text` up to the end of the last message's content (where the template put it last)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text content to continue")
    for content in (final, final.strip()):  # a template may strip the content it renders
        at = text.rfind(content)
        if at >= 0:
            return text[:at + len(content)]
    raise ValueError("continue_final_message: the chat template does not render the last message's content "
                     "as given, so it cannot be continued")
