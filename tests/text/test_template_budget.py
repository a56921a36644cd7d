"""A chat template comes from a downloaded model file: every way it can grow a string, a list or a
number is refused by name before the memory is spent, in a child process under a memory cap.

The child imports the sandbox, caps its address space at what it uses plus CAP_MIB, renders every
case and reports, per case, the error (or the output's length), the time and the growth of its peak
memory. Without the budget, `'x'.ljust(10**10)` asks for 10 GB and a doubling macro for 268 million
characters: the cap turns that into a MemoryError, which the test reports as a failure."""

from __future__ import annotations

import json
import subprocess
import sys

import jinja2
import pytest

from support import ROOT
from minillm.text.chat_template import TEMPLATE_CHARS, TEMPLATE_SECONDS, render_chat

CAP_MIB = 512  # the child's address space above what it uses after its imports
GROWTH_MIB = 64  # the most a refused case may add to the child's peak memory



def doubling(expression: str) -> str:
    """A template that sets a string to `expression` of itself 40 times: 2**40 characters unless stopped."""
    return "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = " + expression + " %}{% endfor %}"


HOSTILE = {  # name: (template, the words the refusal must use)
    "str.ljust(400000000)": ("{{ ('x'.ljust(400000000))|length }}", "pads a string (ljust) of 400,000,000"),
    "str.ljust(10**10)": ("{{ 'x'.ljust(10**10) }}", "pads a string (ljust)"),
    "str.rjust": ("{{ 'x'.rjust(10**9) }}", "pads a string (rjust)"),
    "str.center": ("{{ 'x'.center(10**9) }}", "pads a string (center)"),
    "str.zfill": ("{{ '1'.zfill(10**9) }}", "pads a string (zfill)"),
    "str.expandtabs": ("{{ ('\t' * 1000).expandtabs(10**6) }}", "expands tabs"),
    "str.replace": ("{{ ('x' * 1000000).replace('x', 'yyyy') }}", "replaces into a string of 4,000,000"),
    "str.replace of the empty string": ("{{ ('x' * 100000).replace('', 'abcdefghijk') }}", "replaces"),
    "str.join": ("{% set s = 'x' * 1000000 %}{{ ''.join([s, s, s]) }}", "joins a string"),
    "str.format width": ("{{ '{:>999999999}'.format('x') }}", "pads a field of 999,999,999"),
    "str.format width from an argument": ("{{ '{:>{w}}'.format('x', w=999999999) }}", "width from an argument"),
    "str.format_map width": ("{{ '{a:>999999999}'.format_map({'a': 1}) }}", "pads a field"),
    "str.translate": ("{{ ('a' * 100000).translate({97: 'b' * 100000}) }}", "translates a string"),
    "percent width": ("{{ '%0999999999d' % 1 }}", "pads a field of 999,999,999"),
    "percent star": ("{{ '%*d' % (999999999, 1) }}", "width from an argument"),
    "string times": ("{{ 'a' * 10**9 }}", "repeats a value of 1,000,000,000"),
    "list times": ("{{ 10**9 * ['x'] }}", "repeats a value"),
    "nested list times": ("{% set a = [[[1] * 1000] * 1000] * 1000 %}{{ a|length }}", "repeats a value of 1,001,000"),
    "tilde doubling": (doubling("ns.s ~ ns.s"), "joins a string of 1,048,576"),
    "plus doubling": (doubling("ns.s + ns.s"), "adds a value of 1,048,576"),
    "list plus doubling": ("{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                           "{% endfor %}{{ ns.s|length }}", "adds a value of 1,048,576"),
    "macro doubling its argument 28 times": (
        "{% macro d(s, n) %}{% if n == 0 %}{{ s }}{% else %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}"
        "{{ d('x', 28)|length }}", "joins a string of 1,048,576"),
    "macro output doubling": ("{% macro d(s) %}{{ s }}{{ s }}{% endmacro %}" + doubling("d(ns.s)"), "joins a string"),
    "set block doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set b %}{{ ns.s }}{{ ns.s }}"
                           "{% endset %}{% set ns.s = b %}{% endfor %}", "joins a string of 1,048,576"),
    "filter center": ("{{ 'x'|center(10**9) }}", "pads a string (center)"),
    "filter indent": ("{{ ('x\n' * 100000)|indent(100000) }}", "indents a string"),
    "filter indent by a string": ("{{ ('x\n' * 100000)|indent('-' * 100000) }}", "indents a string"),
    "filter wordwrap": ("{{ ('x ' * 400000)|wordwrap(1, wrapstring='-' * 100) }}", "wraps a string"),
    "filter format": ("{{ '%999999999s'|format('x') }}", "pads a field"),
    "filter format star": ("{{ '%*s'|format(999999999, 'x') }}", "width from an argument"),
    "filter join": ("{% set s = 'x' * 1000000 %}{{ [s, s, s]|join }}", "joins a string"),
    "filter join with a separator": ("{{ ['a', 'b']|join('x' * 999999) }}", "joins a string of 1,000,001"),
    "filter batch": ("{{ [1]|batch(10**9, 0)|list|length }}", "cuts a list into pieces (batch)"),
    "filter slice": ("{{ [1]|slice(10**8)|list|length }}", "cuts a list into pieces (slice)"),
    "filter sum of lists": ("{% set l = [[1] * 999] * 500 %}{{ [l, l, l]|sum(start=[])|length }}", "sums"),
    "filter list of a long string": ("{{ ('x' * 999999)|list|length }}", "builds a value with the list filter"),
    "filter tojson indent": ("{{ messages|tojson(indent=10**9) }}", "indents JSON"),
    "filter pprint": ("{{ messages|pprint }}", "No filter named 'pprint'"),
    "power of a power": ("{% set ns = namespace(n=10) %}{% for i in range(10) %}{% set ns.n = ns.n ** 64 %}"
                         "{% endfor %}", "raises a number"),
    "squaring a number": ("{% set ns = namespace(n=2**60) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                          "{% endfor %}", "multiplies numbers"),
    "power 10**8": ("{{ 2 ** 100000000 }}", "power"),
    "lipsum": ("{{ lipsum(n=10**6) }}", "'lipsum' is undefined"),
    "output size": ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "writes output of"),
    "nested loops over ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                                 "ran for more than"),
    "nested loops over lists": ("{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}{% endfor %}"
                                "{% endfor %}", "ran for more than"),
    "calls in a loop": ("{% for i in range(100000) %}{{ range(100000) | list | length }}{% endfor %}",
                        "ran for more than"),
    "a macro calling itself": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
}
FINE = {  # the same operations at the sizes chat templates use them: they render as Python computes them
    "{{ 'x'.ljust(5) ~ '|' ~ 'y'.center(5, '*') ~ '7'.zfill(3) }}": "x    |**y**007",
    "{{ 'a b'.replace(' ', '_') ~ ', '.join(['u', 'v']) ~ '{:>4}'.format(7) ~ '%03d' % 5 }}": "a_bu, v   7005",
    "{{ ['a', 'b']|join('-') }}{{ 'hi'|center(6) }}{{ 'p\nq'|indent(2) }}{{ '%.2f'|format(1.5) }}": "a-b  hi  p\n  q1.50",
    "{{ [1, 2, 3]|batch(2)|list }}{{ [[1], [2]]|sum(start=[]) }}{{ ('x' * 999990)|length }}": "[[1, 2], [3]][1, 2]999990",
    "{{ messages|tojson(indent=2) }}": json.dumps([{"role": "user", "content": "hi"}], indent=2),
    "{% set ns = namespace(s='ab') %}{% for m in messages %}{% set ns.s = ns.s ~ m.content %}{% endfor %}{{ ns.s }}": "abhi",
    "{{ 2 ** 64 }} {{ (10 ** 20) * (10 ** 20) }}": f"{2 ** 64} {10 ** 40}",
}
CHILD = """
import json, resource, sys, time
from minillm.text.chat_template import render_chat
cases = json.loads(sys.stdin.read())
used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
vm = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + {cap} * 2**20, vm + {cap} * 2**20))
results = {{}}
for name, template in cases.items():
    before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    try:
        outcome = 'rendered ' + str(len(render_chat(template, [{{'role': 'user', 'content': 'hi'}}])))
    except Exception as exc:
        outcome = f'{{type(exc).__name__}}: {{exc}}'
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    results[name] = {{'outcome': outcome, 'seconds': time.monotonic() - start, 'grew_mib': grew}}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def refused() -> dict[str, dict]:
    """Every hostile case rendered once in a capped child process."""
    cases = {name: template for name, (template, _) in HOSTILE.items()}
    run = subprocess.run([sys.executable, "-c", CHILD.format(cap=CAP_MIB)], input=json.dumps(cases), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_refused_by_name_in_bounded_time_and_memory(refused, name):
    outcome = refused[name]
    assert outcome["outcome"].split(":")[0] in {"TemplateError", "SecurityError", "TemplateAssertionError", "UndefinedError"}, outcome
    assert HOSTILE[name][1] in outcome["outcome"], outcome
    assert outcome["seconds"] < TEMPLATE_SECONDS + 1.0, outcome
    assert outcome["grew_mib"] < GROWTH_MIB, outcome


@pytest.mark.parametrize("template", list(FINE))
def test_the_same_operations_at_chat_template_sizes_render(template):
    assert render_chat(template, [{"role": "user", "content": "hi"}]) == FINE[template]


def test_every_refusal_names_the_limit():
    with pytest.raises(jinja2.exceptions.SecurityError, match=f"the limit is {TEMPLATE_CHARS:,}"):
        render_chat("{{ 'x'.ljust(10**7) }}", [{"role": "user", "content": "hi"}])
