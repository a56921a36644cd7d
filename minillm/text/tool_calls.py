# Generated from notebooks/14_structured_outputs.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Tool calls: OpenAI's tools and tool_choice over a chat template, in the Hermes format of Qwen2.5 and
Qwen3 and the XML format of Qwen3.5.

Built in notebooks/14_structured_outputs.ipynb on minillm/text/constrained.py. A model calls a function
by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>, or (Qwen3.5, Qwen3-Coder)
<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>, with newlines between.
"""

from __future__ import annotations

import json
import re
import uuid

from minillm.text.constrained import JSON_LAYOUT
from minillm.text.tokenizer_files import template_named
from minillm.utils.validate import lone_surrogate, shown

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


def call_format(tools: list[dict], choice, style: str = "json") -> dict | None:
    """The response_format that forces a call ("required" or a named function), or None ("auto", "none");
    style "xml" (call_style, below): Qwen3.5's spelling, a Lark grammar."""
    if not isinstance(choice, dict) and choice != "required":
        return None
    allowed = [t["function"] for t in tools if not isinstance(choice, dict) or
               t["function"]["name"] == choice["function"]["name"]]
    if style == "xml":
        return {"type": "tool_call", "lark": xml_call_grammar(allowed)}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]}, "arguments": closed_arguments(f.get("parameters") or None)}}
             for f in allowed]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "tool_call", "schema": schema, "prefix": OPEN, "suffix": CLOSE}


def closed_arguments(schema: dict | None) -> dict:
    """A function's parameters as a forced call follows them (OpenAI's strict mode): every object that lists
    its properties and says nothing of others gets additionalProperties false, at every depth; none: {} alone."""
    if schema is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):  # name -> schema
            value = {name: closed_arguments(s) for name, s in value.items()}
        elif key in ("anyOf", "oneOf", "prefixItems") and isinstance(value, list) and "properties" not in schema:
            value = [closed_arguments(s) for s in value]  # alternatives; beside properties (or allOf) they'd close each other
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = closed_arguments(value)
        out[key] = value
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_prompt(tools: list[dict]) -> str:
    """The system text that describes the functions to a model whose template does not."""
    functions = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You may call functions. To call one, answer with\n" + OPEN + '{"name": <function name>, '
            '"arguments": <its arguments as a JSON object>}' + CLOSE + "\nThe functions:\n" + functions)


def template_messages(messages: list[dict], tools: list[dict], template_has_tools: bool) -> list[dict]:
    """Messages as the template wants them (for one without tools: functions, calls and results as text)."""
    out = []
    for m in messages:
        calls = [{**c["function"], "arguments": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls") or []]
        if template_has_tools:
            out.append({**m, "content": m.get("content") or "", **({"tool_calls": calls} if calls else {})})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            text = "".join(OPEN + json.dumps(c, ensure_ascii=False) + CLOSE for c in calls)
            out.append({"role": m["role"], "content": (m.get("content") or "") + text})
    if tools and not template_has_tools:
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tool_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": tool_prompt(tools)})
    return out


def encode_with_tools(tokenizer, messages: list[dict], tools: list[dict], template_name: str | None = None,
                      **template_kwargs) -> list[int]:
    """Prompt ids of a chat that offers `tools`: rendered by the template if it can, else by the messages
    (template_kwargs: the template's own variables, checked by the caller)."""
    template = tools_template(tokenizer, template_name, bool(tools))
    has_tools = "tools" in (template or "")
    extra = {"tools": tools} if tools and has_tools else {}
    return tokenizer.apply_chat_template(template_messages(messages, tools, has_tools), template_name=template_name,
                                         **template_kwargs, **extra)


def tools_template(tokenizer, template_name: str | None = None, tools: bool = True) -> str | None:
    """The chat template a chat with (or without) tools is rendered by."""
    return template_named(tokenizer.chat_templates, template_name, tokenizer.source, tools, tokenizer.chat_template)


def parse_tool_calls(text: str, tools: list[dict] = ()) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer: each <tool_call> block of JSON {"name", "arguments"}, or of
    Qwen3.5's XML (read by the offered `tools`' schemas, below), is a call."""
    calls = []

    def take(block: re.Match) -> str:
        if block.group(1).startswith("<function="):
            call = read_xml_call(block.group(1), tools)
        else:
            try:
                call = json.loads(block.group(1))
            except json.JSONDecodeError:
                call = None
            valid = isinstance(call, dict) and isinstance(call.get("name"), str)
            call = (call["name"], json.dumps(call.get("arguments", {}))) if valid else None
        if call is None:
            return block.group(0)  # not a call: stays in the content
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call[0], "arguments": call[1]}})
        return ""

    content = CALL.sub(take, text)
    return (content.strip() or None, calls) if calls else (text, [])


def validate_tools(tools, tool_choice) -> tuple[list[dict], str | dict]:
    """(tools, choice) checked against OpenAI's shapes; a ValueError's message starts with the path of the
    field that is wrong ("tools[2].function.parameters must be ...")."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError(f"tool_choice needs tools: got {shown(tool_choice)} and no tools")
        return [], "none"
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"tools must be a non-empty list of {{'type': 'function', 'function': {{...}}}}, "
                         f"got {shown(tools)}")
    where = lone_surrogate(tools, "tools")
    if where is not None:
        raise ValueError(f"{where} holds a lone surrogate (not valid Unicode text)")
    names: dict[str, int] = {}
    for i, tool in enumerate(tools):
        name = checked_function(tool, f"tools[{i}]")["name"]
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is the same name as tools[{names[name]}]'s")
        names[name] = i
    return tools, checked_choice(tool_choice, list(names))


def checked_function(tool, where: str) -> dict:
    """The function of the entry of tools at `where`, each level's type checked before it is read."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}, got {shown(tool)}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object {{'name', 'description', 'parameters'}}, "
                         f"got {shown(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {shown(name)}")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ValueError(f"{where}.function.description must be a string, got {shown(function['description'])}")
    if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
        raise ValueError(f"{where}.function.parameters must be a JSON schema (an object), "
                         f"got {shown(function['parameters'])}")
    return function


def checked_choice(choice, names: list[str]) -> str | dict:
    """tool_choice: "auto" (None), "none", "required" or {"type": "function", "function": {"name": ...}}."""
    if choice is None:
        return "auto"
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return choice
    if not isinstance(choice, dict):
        raise ValueError("tool_choice must be none, auto, required or {'type': 'function', 'function': "
                         f"{{'name': ...}}}}, got {shown(choice)}")
    if choice.get("type") != "function":
        raise ValueError(f"tool_choice.type must be 'function', got {shown(choice.get('type'))}")
    if not isinstance(choice.get("function"), dict):
        raise ValueError(f"tool_choice.function must be an object {{'name': ...}}, got {shown(choice.get('function'))}")
    name = choice["function"].get("name")
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"tool_choice.function.name must name a function of tools ({shown(names, 60)}), "
                         f"got {shown(name)}")
    return choice


XML_OPEN, XML_CLOSE = "<tool_call>\n<function=", "</function>\n</tool_call>"
TAG = re.compile(r"<(function|parameter)=([^<>\n]{1,256})>|</(function|parameter)>")
TAG_STARTS = ("<function=", "<parameter=", "</function>", "</parameter>")


def could_be_tag(text: str) -> bool:
    """Whether text with no '>' yet may still become one of the four tags."""
    return len(text) < 280 and ">" not in text and any(t.startswith(text[:len(t)]) for t in TAG_STARTS)


def call_style(template: str | None) -> str:
    """How the template's model writes a call: "xml" (Qwen3.5, Qwen3-Coder: <function=NAME>) or "json" (Hermes)."""
    return "xml" if template is not None and "<function=" in template else "json"


def types_of(schema) -> list:
    """The JSON types a schema names ([None] if it names none)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    return kind if isinstance(kind, list) else [kind]


def xml_value(text: str, schema: dict | None):
    """A parameter's text as its schema's type reads it: a string as written, any other type as JSON (and
    Python's True/False, as a template's |string writes them); text that does not read stays text."""
    if "string" in types_of(schema):
        return text
    if "boolean" in types_of(schema) and text.strip() in ("True", "False"):
        return text.strip() == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


class XMLCallReader:
    """One call in Qwen3.5's format, a piece at a time (next_piece, then take): its name, then its arguments
    as JSON fragments joining to json.dumps of them. States: function, params, value, close (drawn above)."""

    def __init__(self, tools: list[dict]):
        self.properties = {t["function"]["name"]: ((t["function"].get("parameters") or {}).get("properties") or {})
                           for t in tools}  # name -> {parameter: schema}: how to read the values
        self.state, self.name, self.param, self.seen = "function", None, None, set()
        self.arguments, self.done = [], False  # the JSON fragments so far; </function> read

    def next_piece(self, text: str) -> tuple[str, int] | None:
        """(piece, end): a tag or a value, and where it ends; None while incomplete; ValueError: not a call."""
        if self.state == "value":
            at = text.find("</parameter>")
            return None if at < 0 else (text[:at], at)
        start = len(text) - len(text.lstrip())
        tag = TAG.match(text, start)
        if tag is not None:
            return tag.group(0), tag.end()
        if not could_be_tag(text[start:]):
            raise ValueError(f"not a call's XML at {text[start:start + 20]!r}")
        return None

    def take(self, piece: str) -> None:
        """One piece; ValueError when it does not belong here (a parameter twice is not a call either)."""
        tag = TAG.fullmatch(piece) if self.state != "value" else None
        opens = tag.group(1) if tag else None
        if self.state == "value":
            value = xml_value(piece.removeprefix("\n").removesuffix("\n"), self.properties.get(self.name, {}).get(self.param))
            self.arguments.append(("{" if not self.arguments else ", ") + json.dumps(self.param) + ": " + json.dumps(value))
            self.state = "close"
        elif self.state == "function" and opens == "function":
            self.name, self.state = tag.group(2), "params"
        elif self.state == "params" and opens == "parameter" and tag.group(2) not in self.seen:
            self.param, self.state = tag.group(2), "value"
            self.seen.add(self.param)
        elif self.state == "params" and piece == "</function>":
            self.arguments.append("}" if self.arguments else "{}")
            self.done = True
        elif self.state == "close" and piece == "</parameter>":
            self.state = "params"
        else:
            raise ValueError(f"{piece[:40]!r} does not belong in a call here (state {self.state})")


def read_xml_call(body: str, tools: list[dict]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole block's body in Qwen3.5's format, or None if it is not one."""
    reader, at = XMLCallReader(tools), 0
    try:
        while not reader.done:
            found = reader.next_piece(body[at:])
            if found is None:
                return None
            reader.take(found[0])
            at += found[1]
    except ValueError:
        return None
    return (reader.name, "".join(reader.arguments)) if not body[at:].strip() else None


def xml_call_grammar(functions: list[dict]) -> str:
    """Lark (llguidance's grammar language) for one call of one of `functions` in Qwen3.5's format: the
    tags fixed, the declared parameters in order (the required ones always, closed as in strict mode),
    a string as any text up to its </parameter> (or one of its enum), any other value as JSON of its schema."""
    rules, texts = [], []  # texts: a terminal per free-text value
    for f in functions:
        parameters = closed_arguments(f.get("parameters") or None)
        required, items = set(parameters.get("required") or []), []
        for name, schema in (parameters.get("properties") or {}).items():
            item = f'"<parameter={json.dumps(name)[1:-1]}>\\n" {xml_value_rule(schema, texts)}'
            items.append(item if name in required else f"({item})?")
        rules.append(" ".join([json.dumps(f["name"] + ">\n"), *items]))
    start = f"start: {json.dumps(XML_OPEN)} ({' | '.join(rules)}) {json.dumps(XML_CLOSE)}"
    return "\n".join([start, *(f"TEXT{i}: {text}" for i, text in enumerate(texts))])


def xml_value_rule(schema, texts: list[str]) -> str:
    """The Lark of one parameter's value and its end tag: a string's text (its enum or const if it has one)
    as a terminal added to `texts`, any other value as JSON."""
    end = json.dumps("\n</parameter>\n")
    if "string" not in types_of(schema):
        return "%json " + json.dumps({**(schema if isinstance(schema, dict) else {}), "x-guidance": JSON_LAYOUT}) + " " + end
    options = [schema["const"]] if "const" in schema else schema.get("enum")
    if options:
        return "(" + " | ".join(json.dumps(str(o)) for o in options) + ") " + end
    longest = schema.get("maxLength")
    length = f".{{0,{longest}}}\\n?" if isinstance(longest, int) and longest >= 0 else ".*"
    # the text and its end tag as one lexeme: no </parameter> before the end, and at most maxLength characters
    texts.append(rf'((~/(?s:.*<\/parameter>.*)/) "</parameter>\n") & /(?s:{length})<\/parameter>\n/')
    return f"TEXT{len(texts) - 1}"
