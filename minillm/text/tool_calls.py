# Generated from notebooks/14_structured_outputs.ipynb by tools/nbexport.py: edit the notebook, not this file.

"""Tool calls: OpenAI's tools and tool_choice over a chat template, in the Hermes format of Qwen2.5 and Qwen3.

Built in notebooks/14_structured_outputs.ipynb on minillm/text/constrained.py. A model calls a function
by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
"""

from __future__ import annotations

import json
import re
import uuid

from minillm.text.tokenizer_files import template_named
from minillm.utils.validate import lone_surrogate, shown

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


def call_format(tools: list[dict], choice) -> dict | None:
    """The response_format that forces a call ("required" or a named function), or None ("auto", "none")."""
    if not isinstance(choice, dict) and choice != "required":
        return None
    allowed = [t["function"] for t in tools if not isinstance(choice, dict) or
               t["function"]["name"] == choice["function"]["name"]]
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
    template = template_named(tokenizer.chat_templates, template_name, tokenizer.source, bool(tools),
                              tokenizer.chat_template)
    has_tools = "tools" in (template or "")
    extra = {"tools": tools} if tools and has_tools else {}
    return tokenizer.apply_chat_template(template_messages(messages, tools, has_tools), template_name=template_name,
                                         **template_kwargs, **extra)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer: each <tool_call> block of JSON {"name", "arguments"} is a call."""
    calls = []

    def take(block: re.Match) -> str:
        try:
            call = json.loads(block.group(1))
        except json.JSONDecodeError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return block.group(0)  # not a call: stays in the content
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
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
