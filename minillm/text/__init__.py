"""Text in and out: the tokenizer and chat template (07), grammars, constrained decoding and tool calls (18)."""
