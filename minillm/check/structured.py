"""Exercise checks of notebook 14 (plumbing): the trie walk that lifts a DFA to tokens, and its exploration.

`Vocabulary.allowed` is checked on a small made-up vocabulary whose tokens are prefixes of each
other (`1`, `12`, `120`) and cross from one part of a pattern into the next (`1}`, `, "`), against
the definition of "allowed" rather than a copy of the notebook's walk: a token is allowed in a
state when the DFA reads every one of its bytes from that state without dying (the package's DFA,
token by token). A known mistake is named by the tokens it would allow in every state, computed
here. The exploration counts the tokens SmolLM2's mask allows in the middle of the person schema's
age, with the package's automaton and vocabulary.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace

from minillm.check.harness import close_to, fail, run_check, run_explore
from minillm.text.constrained import Vocabulary
from minillm.text.grammar import DFA, Star, integer_range, lit, schema_pattern, seq
from minillm.text.tokenizer import Tokenizer
from minillm.weights.embedded import embedded_gguf_path

TOKENS = [b"<eos>", b"1", b"12", b"120", b"121", b"2", b"20", b"3", b"30", b"0", b"00", b"9", b"99", b"-", b"-1",
          b",", b", ", b', "', b', "x', b",1", b"a", b"ab", b"abb", b"b", b"b}", b"}", b"1}", b" ", b"\x80", b"x"]
PATTERNS = {  # pattern -> the texts whose states are checked (the start state first)
    "integers 0..120, then , \"x\"": (seq(integer_range(0, 120), lit(', "x"')), [b"", b"1", b"12", b"120", b"99", b"7, "]),
    "a b* }": (seq(lit("a"), Star(lit("b")), lit("}")), [b"", b"a", b"abb"]),
}


def _tokenizer() -> SimpleNamespace:
    """What Vocabulary reads of a tokenizer: token 0 is a special (end-of-sequence) token."""
    return SimpleNamespace(eos_token_ids=(0,), special_ids={0}, vocab_size=len(TOKENS), token_bytes=TOKENS.__getitem__)


def _ids(rule) -> list[int]:
    return [i for i, t in enumerate(TOKENS) if i and rule(t)]


def _prefix_of_another(t: bytes) -> bool:
    return any(u != t and u.startswith(t) for u in TOKENS[1:])


MISTAKES = {  # hint -> the tokens that mistake allows, from (dfa, state)
    "a token is allowed only when the DFA reads ALL of its bytes without dying, not just the first: walk "
    "down the trie, one byte a level":
        lambda dfa, s: _ids(lambda t: dfa.step(s, t[0]) != DFA.DEAD),
    "start the walk from the state you are given, not from dfa.start":
        lambda dfa, s: _ids(lambda t: dfa.read(t, dfa.start) != DFA.DEAD),
    "a token can end at an inner node of the trie (`1` is a prefix of `12`): add the token ids of every node "
    "the walk reaches alive, not only the leaves":
        lambda dfa, s: _ids(lambda t: dfa.read(t, s) != DFA.DEAD and not _prefix_of_another(t)),
    "add a child's tokens only once the DFA is alive after reading the child's byte":
        lambda dfa, s: _ids(lambda t: dfa.read(t[:-1], s) != DFA.DEAD),
}


def vocabulary_allowed(cls) -> bool:
    """Vocabulary(tokenizer, vocab_size).allowed(dfa, state): every token whose bytes the DFA reads from state."""
    def body():
        vocabulary = cls(_tokenizer(), len(TOKENS))
        want, got, mistakes = {}, {}, {hint: {} for hint in MISTAKES}
        for name, (pattern, texts) in PATTERNS.items():
            dfa = DFA(pattern)
            for text in texts:
                state = dfa.read(text)
                answer = vocabulary.allowed(dfa, state)
                if not isinstance(answer, (list, tuple)) or not all(isinstance(t, int) for t in answer):
                    fail(f"allowed returned {answer!r}, expected a list of token ids", "return a list of ints")
                if len(set(answer)) != len(answer):
                    fail(f"{name}, after {text!r}: token ids listed twice: {sorted(answer)}",
                         "each token id once: a token ends at exactly one node of the trie")
                key = (name, text)
                want[key] = _ids(lambda t, dfa=dfa, state=state: dfa.read(t, state) != DFA.DEAD)
                got[key] = sorted(answer)
                for hint, rule in MISTAKES.items():
                    mistakes[hint][key] = rule(dfa, state)
        if got == want:
            return
        wrong = next(k for k in want if got[k] != want[k])
        extra = [TOKENS[t] for t in got[wrong] if t not in want[wrong]]
        missing = [TOKENS[t] for t in want[wrong] if t not in got[wrong]]
        message = (f"pattern {wrong[0]}, after {wrong[1]!r}: allowed {extra} wrongly" if extra else
                   f"pattern {wrong[0]}, after {wrong[1]!r}: forbade") + (f"; forbade {missing}" if extra and missing else
                                                                          "" if extra else f" {missing}")
        for hint, table in mistakes.items():
            if got == table:
                fail(message, hint)
        fail(message, "walk the trie from (root, state): for each child byte b, t = dfa.step(s, b); if t is "
                      "alive, the child's tokens are allowed and its children are walked from t")
    return run_check("Vocabulary.allowed", body)


# ------------------------------------------------------------------ the exploration: a mask in the middle of a number

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", None]},
                         "nickname": {"type": "string", "maxLength": 12}}}
AFTER = b'{"name": "Ann", "age": 12'


@cache
def _smol_vocabulary():
    tok = Tokenizer.from_gguf(embedded_gguf_path())
    return tok, Vocabulary(tok, tok.vocab_size)  # the package's walk, not the student's


@cache
def allowed_after_twelve(maximum: bool = True, kind: str = "all") -> int:
    """How many of SmolLM2's tokens the person schema allows after AFTER. The keywords plant the known
    slips: no maximum on the age; only the tokens that extend the number (kind "digits")."""
    tok, vocabulary = _smol_vocabulary()
    schema = PERSON if maximum else {**PERSON, "properties": {**PERSON["properties"], "age": {"type": "integer"}}}
    dfa = DFA(schema_pattern(schema))
    allowed = vocabulary.allowed(dfa, dfa.read(AFTER))
    if kind == "digits":
        allowed = [t for t in allowed if tok.token_bytes(t).isdigit()]
    return len(allowed)


def explore_allowed_after_twelve(value) -> bool:
    """Tokens of SmolLM2 the person schema's mask allows after {"name": "Ann", "age": 12; exact."""
    def body():
        close_to("allowed_after_twelve", value, allowed_after_twelve(), abs_=0.5, mistakes=[
            ("the schema's maximum is part of the pattern: an age may not pass it",
             allowed_after_twelve(maximum=False)),
            ("after its first two digits the age may go on (up to the maximum) or end: count the tokens that extend it and the "
             "tokens that start what comes after it", allowed_after_twelve(kind="digits"))],
            hint="read the bytes of the text with person.read(...), then ask the vocabulary which tokens the DFA "
                 "reads from that state (vocabulary.allowed) and count them")
    return run_explore("allowed_after_twelve", body)


EXPLORE = {"allowed_after_twelve": explore_allowed_after_twelve}
