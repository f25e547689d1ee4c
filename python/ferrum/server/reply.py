"""A chat reply split into its reasoning (``<think>...</think>``), its text and its tool calls,
whole or as it streams.

Streaming sends only what the whole reply's split is sure to begin with: reasoning up to a
possible end marker, text up to where a call could start; the rest once the reply has ended.
Calls held to well-formed ones by the tools' grammar stream as they are written (each call's name,
then its arguments as far as they are sure); others, once the reply has ended. So a stream joins
to exactly the non-streamed message: a malformed call comes back as text in both, and a call the
grammar held but ``max_tokens`` cut off as the call begun, with its arguments so far (finish
reason ``length``), in both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .tool_calls import PartialCall, ToolCall, ToolFormat, call_id


@dataclass
class ReasoningFormat:
    """A reasoning block between two markers (``--reasoning-parser``: ``deepseek_r1``, ``qwen3``)."""
    start: str = "<think>"
    end: str = "</think>"

    def state_after(self, prompt: str) -> str:
        """"inside" when the prompt leaves a block open (DeepSeek-R1's template ends with
        ``<think>\\n``), "closed" when it ends with one (Qwen3's, without thinking), else "open"."""
        if prompt.rfind(self.start) > prompt.rfind(self.end):
            return "inside"
        return "closed" if prompt.rstrip().endswith(self.end) else "open"

    def split(self, text: str, inside: bool) -> Tuple[Optional[str], str]:
        """(reasoning or None, the rest) of a whole reply."""
        if not inside:
            if not text.lstrip().startswith(self.start):
                return None, text
            text = text.lstrip()[len(self.start):]
        end = text.find(self.end)
        if end < 0:
            return text, ""
        return text[:end], text[end + len(self.end):]


REASONING_FORMATS = {"deepseek_r1": ReasoningFormat(), "qwen3": ReasoningFormat()}


def detect_reasoning(chat_template: Optional[str]) -> Optional[ReasoningFormat]:
    return REASONING_FORMATS["qwen3"] if "</think>" in (chat_template or "") else None


@dataclass
class Message:
    reasoning: Optional[str]
    content: Optional[str]
    tool_calls: List[ToolCall] = field(default_factory=list)
    calls_complete: bool = True  # False: the reply ended inside its last call


class ReplySplitter:
    """How one request's replies split: ``reasoning`` (None: no reasoning parser) that may begin
    inside the block (``inside``), then text and ``tools`` calls (None: no call parsing);
    ``held_calls``: a grammar holds the calls to the format (they stream as they are written)."""

    def __init__(self, reasoning: Optional[ReasoningFormat], inside: bool, tools: Optional[ToolFormat],
                 triggers: List[str], names: List[str], held_calls: bool = False):
        self.reasoning, self.inside, self.tools = reasoning, inside, tools
        self.held_calls = held_calls and tools is not None
        self.names = names  # the tools' names
        self.triggers = triggers
        self._starts = re.compile("|".join(re.escape(t) for t in triggers)) if triggers else None

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tools is None

    def whole(self, text: str) -> Message:
        if self.plain:
            return Message(None, text)
        reasoning, rest = self.reasoning.split(text, self.inside) if self.reasoning else (None, text)
        calls: List[ToolCall] = []
        complete = True
        begun = self.begun(rest)
        if begun:
            rest, calls = rest[:self._starts.search(rest).start()], [ToolCall(c.name, c.arguments) for c in begun]
            complete = begun[-1].complete
        elif self.tools is not None:
            rest, calls = self.tools.parse(rest, self.names)
        content = rest.strip()
        return Message(None if reasoning is None else reasoning.strip(),
                       content or (None if calls else ""), calls, complete)

    def begun(self, text: str) -> List[PartialCall]:
        """With ``held_calls``, the calls `text` (after any reasoning) has begun."""
        found = self._starts.search(text) if self.held_calls and self._starts else None
        return self.tools.begun(text[found.start():]) if found else []

    def call_start(self, text: str) -> int:
        """Where a call could start in `text` (its length when nowhere): the first trigger, or an
        earlier tail that a trigger begins with."""
        if self._starts is None:
            return len(text)
        found = self._starts.search(text)
        end = found.start() if found else len(text)
        for i in range(max(0, len(text) - max(map(len, self.triggers)) + 1), end):
            if any(t.startswith(text[i:]) for t in self.triggers):
                return i
        return end

    def stream(self) -> "ReplyStream":
        return ReplyStream(self)


def _sure_prefix(text: str) -> str:
    """What ``(text + anything).strip()`` surely begins with."""
    return text.strip()


class ReplyStream:
    """One streamed reply: ``feed`` each new piece of text, ``finish`` at its end; each returns
    the deltas to send (``{"reasoning_content": ...}``, ``{"content": ...}``), ``finish`` the
    message's calls as well."""

    def __init__(self, splitter: ReplySplitter):
        self.s = splitter
        self.text = ""
        self.sent: Dict[str, str] = {"reasoning": "", "content": ""}
        self.call_ids: List[str] = []  # of the calls whose name was sent
        self.sent_arguments: List[str] = []

    def feed(self, piece: str) -> List[dict]:
        if self.s.plain:
            return [{"content": piece}] if piece else []
        self.text += piece
        reasoning, rest, reasoning_done = self._sure_parts()
        deltas = self._deltas(reasoning, None)
        if reasoning_done:
            deltas += self._deltas(None, rest[:self.s.call_start(rest)])
        return deltas

    def finish(self) -> Tuple[List[dict], Message]:
        message = self.s.whole(self.text)
        if self.s.plain:
            return [], message
        return self._deltas(message.reasoning or "", message.content or "", final=True), message

    def call_deltas(self) -> List[dict]:
        """The chat chunks' ``tool_calls`` deltas for what the calls have gained since the last
        call: a call's id and name once its name is written, then pieces of its arguments."""
        if not self.s.held_calls:
            return []
        _, rest, reasoning_done = self._sure_parts()
        return self._call_parts(self.s.begun(rest)) if reasoning_done else []

    def finish_calls(self, message: Message) -> List[dict]:
        """After ``finish``: the deltas that complete the message's calls."""
        return self._call_parts(message.tool_calls)

    def _call_parts(self, calls) -> List[dict]:
        out = []
        for k, call in enumerate(calls):
            if k == len(self.call_ids):
                self.call_ids.append(call_id(self.s.tools))
                self.sent_arguments.append("")
                out.append({"tool_calls": [{"index": k, "id": self.call_ids[k], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            sent = self.sent_arguments[k]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments[len(sent):]}}]})
                self.sent_arguments[k] = call.arguments
        return out

    def _sure_parts(self) -> Tuple[str, str, bool]:
        """(reasoning so far, text after it, whether the reasoning is over) of a reply in flight."""
        r = self.s.reasoning
        if r is None:
            return "", self.text, True
        text, inside = self.text, self.s.inside
        if not inside:
            head = text.lstrip()
            if r.start.startswith(head) and len(head) < len(r.start):
                return "", "", False  # may still open a block
            if not head.startswith(r.start):
                return "", text, True
            text = head[len(r.start):]
        end = text.find(r.end)
        if end >= 0:
            return text[:end], text[end + len(r.end):], True
        held = next((i for i in range(max(0, len(text) - len(r.end) + 1), len(text))
                     if r.end.startswith(text[i:])), len(text))
        return text[:held], "", False

    def _deltas(self, reasoning: Optional[str], content: Optional[str], final: bool = False) -> List[dict]:
        out = []
        for key, value in (("reasoning", reasoning), ("content", content)):
            if value is None:
                continue
            sure = value if final else _sure_prefix(value)
            new = sure[len(self.sent[key]):] if sure.startswith(self.sent[key]) else ""
            if new:
                self.sent[key] = sure
                out.append({"reasoning_content": new, "reasoning": new} if key == "reasoning" else {"content": new})
        return out
