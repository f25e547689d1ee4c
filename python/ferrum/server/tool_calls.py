"""Tool calls in the model's own format: parsing them out of a reply, and the llguidance grammar
that holds a reply to calls of the given tools.

Formats (``--tool-call-parser`` names, vLLM's): ``hermes`` (Hermes, Qwen2.5, Qwen3:
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), ``llama3_json`` (Llama 3.x:
``{"name": ..., "parameters": ...}``, calls separated by ``;``), ``mistral``
(``[TOOL_CALLS][{"name": ..., "arguments": ...}]``, or ``[TOOL_CALLS]name{...}``) and
``pythonic`` (``[get_weather(city="Paris"), ...]``). ``detect_format`` picks one from a chat
template's text, as llama.cpp does.

A call whose text does not parse (bad JSON, no name, cut off) stays in the reply's text.
``begun`` reads the calls of a reply in flight, as far as they are written: what streams a call's
name and then its arguments as they come (for replies the grammar holds to well-formed calls).
"""
from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

# The JSON a format's grammar writes: one space after ':' and ',', as the models write it.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON object text


@dataclass
class PartialCall:
    """A call as far as a reply in flight has written it: its name, the JSON text its arguments
    surely begin with (as ``ToolCall.arguments`` will), and whether the call is whole."""
    name: str
    arguments: str
    complete: bool


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call_from(obj: Any, argument_keys: Sequence[str] = ("arguments", "parameters")) -> Optional[ToolCall]:
    """A call from a parsed {"name": ..., "arguments": {...}} object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], _dumps(args))


def _json_values(text: str) -> Tuple[List[Any], str]:
    """The JSON values at the start of `text` (separated by whitespace, ',' or ';') and what
    follows the last one."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text) or text[i] not in "{[":
            return values, text[i:]
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return values, text[i:]
        values.append(value)


_WS = " \t\r\n"


def _skip(text: str, i: int, chars: str = _WS) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


@dataclass
class _ObjectScan:
    """A JSON object as far as it is written: its whole key / value pairs, the key whose value is
    being written (and where that value starts), and the index after its ``}`` (-1: open)."""
    pairs: List[Tuple[str, Any]] = field(default_factory=list)
    open_key: Optional[str] = None
    open_at: int = -1
    end: int = -1


def _scan_object(text: str, i: int) -> _ObjectScan:
    """The object starting at ``text[i] == "{"``. A value counts as whole once the ``,`` or ``}``
    after it is written (a number could go on before that)."""
    decoder, scan = json.JSONDecoder(), _ObjectScan()
    i = _skip(text, i + 1)
    if text.startswith("}", i):
        scan.end = i + 1
        return scan
    while True:
        try:
            key, i = decoder.raw_decode(text, i)
        except ValueError:
            return scan
        i = _skip(text, i)
        if not isinstance(key, str) or not text.startswith(":", i):
            return scan
        scan.open_key, scan.open_at = key, _skip(text, i + 1)
        try:
            value, i = decoder.raw_decode(text, scan.open_at)
        except ValueError:
            return scan
        i = _skip(text, i)
        if i >= len(text) or text[i] not in ",}":
            return scan
        scan.pairs.append((key, value))
        scan.open_key = None
        if text[i] == "}":
            scan.end = i + 1
            return scan
        i = _skip(text, i + 1)


def _arguments_text(pairs: Sequence[Tuple[str, Any]], closed: bool) -> str:
    """The arguments' JSON as ``_dumps`` writes the whole object, for the pairs written so far."""
    return "{" + ", ".join(f"{_dumps(k)}: {_dumps(v)}" for k, v in pairs) + ("}" if closed else "")


def _begun_json_call(text: str, i: int, argument_keys: Sequence[str]) -> Tuple[Optional[PartialCall], int]:
    """The ``{"name": ..., "arguments": {...}}`` call at ``text[i] == "{"`` (None until its name
    is written) and the index after it (-1 while it is open)."""
    outer = _scan_object(text, i)
    fields = dict(outer.pairs)
    name = fields.get("name")
    if not isinstance(name, str) or not name:
        return None, outer.end
    whole = _call_from(fields, argument_keys) if outer.end >= 0 else None
    if whole is not None:
        return PartialCall(name, whole.arguments, True), outer.end
    arguments = ""
    written = next((fields[k] for k in argument_keys if k in fields), None)
    if isinstance(written, dict):
        arguments = _dumps(written)
    elif outer.open_key in argument_keys and text.startswith("{", outer.open_at):
        inner = _scan_object(text, outer.open_at)
        arguments = _arguments_text(inner.pairs, inner.end >= 0)
    return PartialCall(name, arguments, False), outer.end


def _begun_json_calls(text: str, i: int, argument_keys: Sequence[str], separators: str,
                      end: str = "") -> List[PartialCall]:
    """Call objects from ``text[i]`` on, separated by whitespace and `separators`, up to `end`."""
    calls = []
    while True:
        i = _skip(text, i, _WS + separators)
        if not text.startswith("{", i):
            return calls
        call, i = _begun_json_call(text, i, argument_keys)
        if call is not None:
            calls.append(call)
        if call is None or i < 0:
            return calls


class ToolFormat:
    """One format: ``triggers`` (text that starts a call), ``parse`` (a reply into its text and
    calls) and ``grammar`` (Lark for llguidance, from the first trigger on)."""

    name = ""
    triggers: Tuple[str, ...] = ()

    def parse(self, text: str, names: Sequence[str]) -> Tuple[str, List[ToolCall]]:
        """(the text outside the calls, the calls); `names`: the request's tools."""
        raise NotImplementedError

    def triggers_for(self, names: Sequence[str]) -> List[str]:
        """The text that starts a call of one of these tools."""
        return list(self.triggers)

    def begun(self, text: str) -> List[PartialCall]:
        """The calls of a reply in flight that begins with a trigger, as far as they are written
        the way this format's grammar writes them; once whole, each as ``parse`` reads it."""
        return []

    def grammar(self, tools: Sequence[dict], parallel: bool, marker) -> str:
        """Lark text whose ``start`` is the calls as this format writes them; ``marker(text)``
        gives a marker string's Lark form (its special token when the tokenizer has one)."""
        raise NotImplementedError


def _function(tool: dict) -> dict:
    return tool.get("function", tool)


def _parameters(tool: dict) -> dict:
    """The arguments' schema; with declared properties and no word on others, only those: a
    call the grammar writes then still matches the schema, and cannot run on in made-up keys."""
    params = _function(tool).get("parameters") or {"type": "object"}
    if "properties" in params and "additionalProperties" not in params:
        params = {**params, "additionalProperties": False}
    return params


def _call_schema(tool: dict, arguments_key: str = "arguments") -> dict:
    return {"type": "object", "properties": {"name": {"const": _function(tool)["name"]},
                                             arguments_key: _parameters(tool)},
            "required": ["name", arguments_key], "additionalProperties": False, "x-guidance": _COMPACT}


def _json_call_rules(tools: Sequence[dict], arguments_key: str = "arguments") -> str:
    """Lark rules: ``call`` is one JSON call object of any of the tools."""
    rules = [f"call_{i}: %json {json.dumps(_call_schema(t, arguments_key))}" for i, t in enumerate(tools)]
    return "call: " + " | ".join(f"call_{i}" for i in range(len(tools))) + "\n" + "\n".join(rules) + "\n"


class Hermes(ToolFormat):
    name = "hermes"
    triggers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text, names):
        content, calls, last = [], [], 0
        for m in self._BLOCK.finditer(text):
            values, rest = _json_values(m.group(1).strip())
            call = _call_from(values[0]) if len(values) == 1 and not rest.strip() else None
            closed = m.group(0).endswith("</tool_call>")
            if call is None or not (closed or m.end() == len(text)):
                continue
            content.append(text[last:m.start()])
            calls.append(call)
            last = m.end()
        content.append(text[last:])
        return "".join(content), calls

    def begun(self, text):
        calls, at = [], text.find("<tool_call>")
        while at >= 0:
            found = _begun_json_calls(text, at + len("<tool_call>"), ("arguments", "parameters"), "")
            calls += found[:1]
            if not found or not found[0].complete:
                return calls
            at = text.find("<tool_call>", at + 1)
        return calls

    def grammar(self, tools, parallel, marker):
        block = f'{marker("<tool_call>")} "\\n" call "\\n" {marker("</tool_call>")}'
        more = ' ("\\n" block)*' if parallel else ""
        return f"start: block{more}\nblock: {block}\n" + _json_call_rules(tools)


class Llama3Json(ToolFormat):
    name = "llama3_json"
    triggers = ("<|python_tag|>", '{"name"')
    _START = re.compile(r'<\|python_tag\|>|\{"name"')

    def parse(self, text, names):
        m = self._START.search(text)
        if m is None:
            return text, []
        rest = text[m.end():] if m.group(0) == "<|python_tag|>" else text[m.start():]
        values, after = _json_values(rest)
        calls = [_call_from(v) for v in values]
        if not calls or None in calls or after.strip():
            return text, []
        return text[:m.start()], calls

    def begun(self, text):
        m = self._START.match(text)
        if m is None:
            return []
        start = m.end() if m.group(0) == "<|python_tag|>" else 0
        return _begun_json_calls(text, start, ("parameters", "arguments"), ";,")

    def grammar(self, tools, parallel, marker):
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\n" + _json_call_rules(tools, "parameters")


class Mistral(ToolFormat):
    name = "mistral"
    triggers = ("[TOOL_CALLS]",)
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[ARGS\])?")

    def parse(self, text, names):
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        calls: List[Optional[ToolCall]] = []
        for part in text[at:].split("[TOOL_CALLS]")[1:]:
            values, after = _json_values(part)
            if len(values) == 1 and isinstance(values[0], list) and not after.strip():
                calls += [_call_from(v) for v in values[0]] or [None]
                continue
            named = self._NAMED.match(part)  # v11 and later: name, [ARGS], the arguments
            values, after = _json_values(part[named.end():]) if named else ([], part)
            if not named or len(values) != 1 or after.strip():
                return text, []
            calls.append(_call_from({"name": named.group(1), "arguments": values[0]}))
        if not calls or None in calls:
            return text, []
        return text[:at], calls

    def begun(self, text):
        if not text.startswith("[TOOL_CALLS]"):
            return []
        i = _skip(text, len("[TOOL_CALLS]"))
        return _begun_json_calls(text, i + 1, ("arguments", "parameters"), ",") if text.startswith("[", i) else []

    def grammar(self, tools, parallel, marker):
        more = ' (", " call)*' if parallel else ""
        return f'start: {marker("[TOOL_CALLS]")} "[" call{more} "]"\n' + _json_call_rules(tools)


class Pythonic(ToolFormat):
    """``[f(a=1, b="x"), g()]``: keyword arguments with Python (or JSON) literal values."""
    name = "pythonic"
    _LITERALS = {"true": True, "false": False, "null": None}

    def triggers_for(self, names):
        return [f"[{name}(" for name in names]

    def parse(self, text, names):
        starts = [i for i in (text.find(t) for t in self.triggers_for(names)) if i >= 0]
        calls = self._calls(text[min(starts):].strip()) if starts else None
        return (text[:min(starts)], calls) if calls else (text, [])

    _NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\(")
    _KEY = re.compile(r"\s*([A-Za-z_]\w*)\s*=\s*")

    def begun(self, text):
        """Keyword values as the grammar writes them: JSON."""
        if not text.startswith("["):
            return []
        calls, i, decoder = [], 1, json.JSONDecoder()
        while True:
            m = self._NAME.match(text, i)
            if m is None:
                return calls
            pairs, i, closed = [], m.end(), False
            while True:
                i = _skip(text, i)
                if text.startswith(")", i):
                    closed = True
                    break
                key = self._KEY.match(text, i)
                if key is None:
                    break
                try:
                    value, i = decoder.raw_decode(text, key.end())
                except ValueError:
                    break
                i = _skip(text, i)
                if i >= len(text) or text[i] not in ",)":
                    break
                pairs.append((key.group(1), value))
                i += text[i] == ","
            calls.append(PartialCall(m.group(1), _arguments_text(pairs, closed) if closed or pairs else "{", closed))
            if not closed:
                return calls
            i = _skip(text, i + 1)
            if not text.startswith(",", i):
                return calls
            i += 1

    def _calls(self, text: str) -> Optional[List[ToolCall]]:
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
                return None
            try:
                args = {kw.arg: self._value(kw.value) for kw in node.keywords}
            except ValueError:
                return None
            if None in args:  # **kwargs
                return None
            calls.append(ToolCall(ast.unparse(node.func), _dumps(args)))
        return calls

    def _value(self, node):
        if isinstance(node, ast.Name) and node.id in self._LITERALS:
            return self._LITERALS[node.id]
        if isinstance(node, ast.List):
            return [self._value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self._value(k): self._value(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)  # ValueError for anything but a literal

    def grammar(self, tools, parallel, marker):
        rules = []
        for i, tool in enumerate(tools):
            params = _parameters(tool)
            props = params.get("properties") or {}
            required = [k for k in props if k in set(params.get("required") or ())]
            optional = [k for k in props if k not in required]
            for key in props:
                schema = {**props[key], "x-guidance": _COMPACT}
                rules.append(f"arg_{i}_{key}: {json.dumps(key + '=')} %json {json.dumps(schema)}")

            def arg(key):
                return f"arg_{i}_{key}"

            def rest(keys):  # each of these, in order, or not
                return " ".join(f'(", " {arg(k)})?' for k in keys)
            if required:  # the required arguments, then any of the others
                args = ' ", " '.join(arg(k) for k in required) + " " + rest(optional)
            elif optional:  # any of them in order, or none
                args = "(" + " | ".join(f"{arg(k)} {rest(optional[j + 1:])}" for j, k in enumerate(optional)) + ")?"
            else:
                args = '""'
            rules.append(f'call_{i}: {json.dumps(_function(tool)["name"] + "(")} {args} ")"')
        more = ' (", " call)*' if parallel else ""
        return (f'start: "[" call{more} "]"\ncall: ' + " | ".join(f"call_{i}" for i in range(len(tools))) + "\n"
                + "\n".join(rules) + "\n")


FORMATS: Dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral(), Pythonic())}


def detect_format(chat_template: Optional[str]) -> Optional[ToolFormat]:
    """The tool-call format a chat template writes calls in, from its text (as llama.cpp
    tells them apart), or None when it shows none."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"]
    if "[func_name1(" in t or "<|python_start|>" in t:
        return FORMATS["pythonic"]
    if "<|start_header_id|>" in t and ("<|python_tag|>" in t or "ipython" in t):
        return FORMATS["llama3_json"]
    return None


_ID_CHARS = string.ascii_letters + string.digits


def call_id(fmt: ToolFormat) -> str:
    """A new call's id: Mistral's templates want nine letters and digits."""
    if fmt.name == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return "call_" + secrets.token_hex(12)
