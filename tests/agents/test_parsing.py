"""parse_assistant: tagged, bare and fenced calls; junk never raises."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trace_core.agents.chat import render_assistant
from trace_core.agents.parsing import INVALID_NAME, MAX_REPLY_CHARS, parse_assistant
from trace_core.schemas import Message, ToolCall


def tc(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_single_tagged_call():
    m = parse_assistant(tc("cancel_pending_order", {"order_id": "#W1", "reason": "no longer needed"}))
    assert m.role == "assistant" and m.content is None
    assert [(c.id, c.name, c.arguments, c.parse_error) for c in m.tool_calls] == [
        ("call_0", "cancel_pending_order", {"order_id": "#W1", "reason": "no longer needed"}, None)
    ]
    assert m.raw.startswith("<tool_call>")


def test_several_calls_and_text_outside():
    text = "Let me check.\n" + tc("a", {"x": 1}) + "\n" + tc("b", {}) + "\nDone?"
    m = parse_assistant(text, start_index=5)
    assert [c.name for c in m.tool_calls] == ["a", "b"]
    assert [c.id for c in m.tool_calls] == ["call_5", "call_6"]
    assert m.content == "Let me check.\n\n\nDone?"


def test_unclosed_last_block():
    m = parse_assistant('<tool_call>\n{"name": "get_order_details", "arguments": {"order_id": "#W2"}}')
    assert m.tool_calls[0].name == "get_order_details" and m.tool_calls[0].parse_error is None
    assert m.tool_calls[0].arguments == {"order_id": "#W2"}


def test_unclosed_truncated_block_is_error_with_guessed_name():
    m = parse_assistant('<tool_call>\n{"name": "find_user", "arguments": {"zip": "123')
    (c,) = m.tool_calls
    assert c.name == "find_user" and c.arguments == {} and "unclosed" in c.parse_error


def test_trailing_end_of_turn_is_tolerated():
    m = parse_assistant(tc("a", {"k": "v"}) + "<|im_end|>")
    assert m.tool_calls[0].parse_error is None and m.content is None


def test_extra_closing_brace_is_tolerated():
    m = parse_assistant('<tool_call>{"name": "a", "arguments": {"k": 1}}}</tool_call>')
    assert m.tool_calls[0].arguments == {"k": 1} and m.tool_calls[0].parse_error is None


def test_list_inside_block():
    m = parse_assistant('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"q": 2}}]</tool_call>')
    assert [c.name for c in m.tool_calls] == ["a", "b"]


def test_arguments_as_json_string():
    m = parse_assistant('<tool_call>{"name": "a", "arguments": "{\\"k\\": 3}"}</tool_call>')
    assert m.tool_calls[0].arguments == {"k": 3} and m.tool_calls[0].parse_error is None


@pytest.mark.parametrize(
    "body, name, needle",
    [
        ('{"name": "a", "arguments": "not json"}', "a", "not valid JSON"),
        ('{"name": "a", "arguments": [1, 2]}', "a", "must be a JSON object"),
        ('{"name": "a", "arguments": "[1]"}', "a", "must be a JSON object"),
        ('{"arguments": {}}', INVALID_NAME, 'no "name"'),
        ('{"name": 7, "arguments": {}}', INVALID_NAME, 'no "name"'),
        ('{"name": "  ", "arguments": {}}', INVALID_NAME, 'no "name"'),
        ("[]", INVALID_NAME, "empty list"),
        ("42", INVALID_NAME, "JSON object"),
        ("", INVALID_NAME, "empty"),
        ('{"name": "b", "arguments": {"x": NaN}}', "b", "invalid JSON"),
        ("call the thing please", INVALID_NAME, "invalid JSON"),
        ('{"name": "weird\\"name", "arguments": {', 'weird"name', "invalid JSON"),
    ],
)
def test_junk_inside_tags_becomes_parse_error(body, name, needle):
    m = parse_assistant(f"<tool_call>{body}</tool_call>")
    (c,) = m.tool_calls
    assert c.name == name and c.arguments == {} and needle in c.parse_error, c


def test_missing_arguments_means_empty_and_parameters_alias():
    m = parse_assistant(
        '<tool_call>{"name": "list_all"}</tool_call><tool_call>{"name": "b", "parameters": {"z": 1}}</tool_call>'
    )
    assert [(c.name, c.arguments, c.parse_error) for c in m.tool_calls] == [
        ("list_all", {}, None),
        ("b", {"z": 1}, None),
    ]


def test_bare_json_object_and_list():
    m = parse_assistant('Sure. {"name": "a", "arguments": {"k": "v"}} ok')
    assert m.tool_calls[0].name == "a" and m.content == "Sure.  ok"
    m = parse_assistant('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{}"}]')
    assert [c.name for c in m.tool_calls] == ["a", "b"] and m.content is None


def test_fenced_json():
    m = parse_assistant('Here:\n```json\n{"name": "a", "arguments": {"k": [1, 2]}}\n```\nThanks')
    assert m.tool_calls[0].arguments == {"k": [1, 2]}
    assert m.content == "Here:\n\nThanks"


def test_bare_malformed_call_is_reported():
    m = parse_assistant('{"name": "cancel", "arguments": {"order_id": "#W1"')
    (c,) = m.tool_calls
    assert c.name == "cancel" and c.parse_error and c.arguments == {}


def test_plain_text_and_non_call_json_stay_content():
    m = parse_assistant("Hello! How can I help you today?")
    assert m.tool_calls is None and m.content == "Hello! How can I help you today?"
    m = parse_assistant('The order is {"id": 3, "status": "pending"}.')
    assert m.tool_calls is None and "pending" in m.content
    assert parse_assistant("   \n").content is None
    assert parse_assistant("").content is None and parse_assistant("").raw == ""


def test_stray_closing_tag_is_dropped_from_content():
    m = parse_assistant('{"name": "a", "arguments": {}}</tool_call>')
    assert m.tool_calls[0].name == "a" and m.content is None


def test_pathological_inputs_are_fast_and_safe():
    for text in [
        "[" * 5000,
        "{" * 5000,
        '{"name":' * 2000,
        "<tool_call>" * 500,
        "1" * 6000,
        '<tool_call>{"name": "a", "arguments": ' + "[" * 3000,
    ]:
        m = parse_assistant(text)
        assert m.raw == text


def _best_times(fn, small: str, big: str, repeat: int = 7) -> tuple[float, float]:
    """Best of `repeat` runs of each text, the two interleaved so that a slow spell of a shared machine hits both
    sizes alike, with the cyclic GC off (its full collections over the many ToolCall objects would add a
    superlinear term that has nothing to do with the parser)."""
    best = [float("inf"), float("inf")]
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeat):
            for k, text in enumerate((small, big)):
                start = time.perf_counter()
                fn(text)
                best[k] = min(best[k], time.perf_counter() - start)
    finally:
        gc.enable()
    return best[0], best[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "unit, n", [("<tool_call>", 16_000), ("</s>", 64_000)], ids=["unclosed_tags", "trailers"]
)
def test_parser_time_is_linear_in_the_reply(unit, n):
    # Issue #35: 64,000 unclosed tags took ~13x as long as 16,000 (every block searched the rest of the text for a
    # closing tag), and each trailing end-of-turn marker was stripped with a copy of the whole text. The parser
    # itself (no size cap) must scale linearly: the bound on the 4x-longer text is a ratio below 6.
    # This is a complexity check, not a speed target: `n` is chosen so that the smaller text takes tens of
    # milliseconds (16,000 trailers took ~0.01 s, and one CI run measured a 7.3 ratio from timer noise alone).
    # Timed in a fresh interpreter: inside the suite, the heap hundreds of earlier tests left behind slowed the bigger
    # text's allocations (ratio 6.0 there on a quiet 2-core Xeon, 4.0-4.1 for the same texts alone).
    code = ("from tests.agents.test_parsing import _best_times\n"
            "from trace_core.agents.parsing import _parse\n"
            f"print(*_best_times(_parse, 'hi' + {unit!r} * {n}, 'hi' + {unit!r} * {4 * n}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    small, big = map(float, done.stdout.split())
    assert big / small < 6, f"{4 * n}/{n} time ratio {big / small:.1f} ({big:.3f} s vs {small:.3f} s)"


@pytest.mark.timeout(120)
def test_megabyte_reply_is_capped_and_fast():
    # Issue #35: 4-9 MB replies never finished parsing. Only the first MAX_REPLY_CHARS are parsed; raw stays whole.
    text = "<tool_call>" * (8_000_000 // len("<tool_call>"))
    start = time.perf_counter()
    m = parse_assistant(text)
    assert time.perf_counter() - start < 1.0  # a generous bound, as the issue asks (~0.05 s measured)
    assert m.raw == text
    assert 0 < len(m.tool_calls) <= MAX_REPLY_CHARS // len("<tool_call>")


def test_text_beyond_the_cap_is_dropped_not_an_error():
    call = tc("find_user", {"zip": "12345"})
    m = parse_assistant(call + "x" * (3 * MAX_REPLY_CHARS) + tc("late_call", {}))
    assert [(c.name, c.parse_error) for c in m.tool_calls] == [("find_user", None)]
    assert len(m.content) <= MAX_REPLY_CHARS


# ---- properties -----------------------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=8), ch, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=10), json_values, max_size=4)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
prose = st.text(max_size=40).filter(
    lambda s: (
        "<tool_call>" not in s
        and "</tool_call>" not in s
        and "{" not in s
        and "[" not in s
        and "`" not in s
        and "<|" not in s
    )
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_arbitrary_text_never_raises(text):
    m = parse_assistant(text)
    assert m.role == "assistant" and m.raw == text
    for c in m.tool_calls or []:
        assert isinstance(c.arguments, dict) and c.name


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from('<>{}[]"\\:,/ _tool_callnamearguments\n'), max_size=80), max_size=4))
def test_tag_soup_never_raises(parts):
    text = "<tool_call>".join(parts)
    m = parse_assistant(text)
    assert m.raw == text


@settings(max_examples=200, deadline=None)
@given(prose, st.lists(st.tuples(names, arguments), min_size=1, max_size=3))
def test_well_formed_calls_round_trip(content, calls):
    msg = Message(
        role="assistant", content=content.strip() or None, tool_calls=[ToolCall(name=n, arguments=a) for n, a in calls]
    )
    text = render_assistant(msg, end_of_turn=False)
    parsed = parse_assistant(text)
    assert [(c.name, c.arguments, c.parse_error) for c in parsed.tool_calls] == [(n, a, None) for n, a in calls]
    assert parsed.content == msg.content
    # and with the end-of-turn token left in, and as bare JSON
    assert [(c.name, c.arguments) for c in parse_assistant(text + "<|im_end|>").tool_calls] == list(calls)
    bare = json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    assert [(c.name, c.arguments) for c in parse_assistant(bare).tool_calls] == list(calls)


def test_tags_quoted_inside_arguments_do_not_cut_a_call():
    # Found by hypothesis: an argument string containing "<tool_call>" used to split the block.
    call = {"name": "A", "arguments": {"note": "see <tool_call> and </tool_call>"}}
    tagged = parse_assistant(f"Sure.\n<tool_call>\n{json.dumps(call)}\n</tool_call>")
    assert [(c.name, c.arguments, c.parse_error) for c in tagged.tool_calls] == [("A", call["arguments"], None)]
    assert tagged.content == "Sure."
    bare = parse_assistant(json.dumps([call]))
    assert [(c.name, c.arguments) for c in bare.tool_calls] == [("A", call["arguments"])]
