"""What a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask of its reply:
the template's tools, the format to parse calls in, and the grammar that holds the reply to
them (``required`` / a named function: from the first token; ``auto``: lazily, from the first
call's marker on, so free text stays free)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import List, Optional

from ..structured import StructuredOutputsParams, llguidance_tokenizer
from .reply import ReasoningFormat, ReplySplitter
from .tool_calls import ToolCall, ToolFormat, call_id


@dataclass
class ToolPlan:
    template_tools: Optional[list]  # what the chat template gets as `tools`
    format: Optional[ToolFormat]  # None: calls are not parsed
    names: List[str]
    constraint: Optional[StructuredOutputsParams]


def plan_tools(tools: Optional[list], tool_choice, parallel: bool, fmt: ToolFormat, tokenizer,
               reasoning: Optional[ReasoningFormat], reasoning_state: str) -> ToolPlan:
    """ValueError for tools or a tool_choice that cannot be honoured. A forced call may follow
    the reasoning: `reasoning_state` says whether the prompt left the reply "inside" a block, one
    may "open", or the prompt "closed" it (``enable_thinking: false``)."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}")
    if not tools:
        if choice not in ("auto", "none"):
            raise ValueError("tool_choice needs tools")
        return ToolPlan(None, None, [], None)
    names = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"each tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {t!r}")
        if not isinstance(f.get("parameters") or {}, dict):
            raise ValueError(f"tool {f['name']!r}: parameters must be a JSON schema object")
        names.append(f["name"])
    if choice == "none":
        return ToolPlan(None, None, [], None)
    chosen = tools
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools {names}")
        chosen = [tools[names.index(name)]]
        parallel = False

    def marker(text: str) -> str:
        """A marker as Lark: its special token when the tokenizer has it as one."""
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and llguidance_tokenizer(tokenizer).is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    if choice == "auto":
        constraint = None  # a tokenizer llguidance cannot take (SentencePiece): calls are only parsed
        if tokenizer.hf_tokenizer is not None and tokenizer.eos_token_ids:
            constraint = StructuredOutputsParams(grammar=fmt.grammar(chosen, parallel, marker),
                                                 triggers=fmt.triggers_for(names), disable_any_whitespace=True)
    else:
        grammar = fmt.grammar(chosen, parallel, marker)
        if reasoning is not None and reasoning_state != "closed":
            grammar = _after_reasoning(grammar, reasoning, marker, reasoning_state == "inside")
        constraint = StructuredOutputsParams(grammar=grammar, disable_any_whitespace=True)
    return ToolPlan(tools, fmt, names, constraint)


def _after_reasoning(grammar: str, r: ReasoningFormat, marker, inside: bool) -> str:
    """The calls' grammar after a reasoning block (optional unless the prompt opened it)."""
    start, end = marker(r.start), marker(r.end)
    calls = grammar.replace("start:", "calls:", 1)
    ws = "/[ \\t\\n]*/"
    if start.startswith("<[") and end.startswith("<["):  # special tokens, which text cannot hold
        body = f"/(?s:.*)/ {end}"
        return calls + (f"start: {body} {ws} calls\n" if inside else f"start: ({start} {body})? {ws} calls\n")
    body = "/(?s:.*)" + re.escape(r.end).replace("/", "\\/") + "/"
    think = f"think[lazy]: {body}\n" if inside else f"think[lazy]: {start} {body}\n"
    return calls + f"start: think{'' if inside else '?'} {ws} calls\n" + think


def tool_calls_json(calls: List[ToolCall], fmt: ToolFormat) -> List[dict]:
    return [{"id": call_id(fmt), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def splitter(plan: ToolPlan, reasoning: Optional[ReasoningFormat], inside: bool) -> ReplySplitter:
    triggers = plan.format.triggers_for(plan.names) if plan.format else []
    return ReplySplitter(reasoning, inside, plan.format, triggers, plan.names, held_calls=plan.constraint is not None)
