"""Reading tool calls out of replies: Hermes blocks and Llama-3 JSON, streamed in any split, or whole."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from server.anthropic.answers import tool_input
from server.engine.grammar import Grammars
from server.serving.call_syntax import HERMES, LLAMA3_JSON, CallSyntax
from server.serving.tool_reader import Reading, ToolReader, read_reply
from server.serving.tools import (
    MAX_FORCED_STRING,
    MAX_OPEN_MEMBERS,
    ToolSpec,
    ToolUse,
    chat_template,
    forced_arguments,
    model_tool_format,
    tool_format,
)
from server.serving.tools import grammar as tool_grammar

TOOLS = ToolUse((ToolSpec("get_weather", None, {"type": "object"}), ToolSpec("add", None, {"type": "object"})))
REPLY = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
)


def streamed(text: str, size: int, tools: ToolUse = TOOLS, syntax: CallSyntax = HERMES) -> tuple[str, list, dict]:
    reader = ToolReader(tools, syntax, "req")
    content, calls = "", []
    for start in range(0, len(text), size):
        sent, found = reader.feed(text[start : start + size])
        content, calls = content + sent, calls + found
    sent, found = reader.finish()
    return content + sent, calls + found, reader.message()


def split_everywhere(reader_of, text: str):
    """The text fed in two pieces, split at every position, then one character at a time: (content, calls)."""
    splits = [[text[:at], text[at:]] for at in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        reader = reader_of()
        content, calls = "", []
        for piece in pieces:
            sent, found = reader.feed(piece)
            content, calls = content + sent, calls + found
        sent, found = reader.finish()
        yield content + sent, calls + found, reader.message()


@pytest.mark.parametrize("size", [1, 2, 5, 13, 1000])
def test_calls_are_the_same_in_any_split_and_whole(size):
    content, calls, message = streamed(REPLY, size)
    assert content == "Let me check. "  # what precedes the first call; nothing of a call leaks as content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city":"Paris"}'),
        ("add", '{"a":1,"b":2}'),
    ]
    assert message == read_reply(REPLY, TOOLS, HERMES, "req")  # streamed or whole: one answer, the same ids


def test_text_that_only_looks_like_a_call_stays_content():
    for text in (
        "a <tool_call>{not json}</tool_call> b",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>',  # a name that is no string (unhashable)
        '<tool_call>{"name": {"add": 1}, "arguments": {}}</tool_call>',
        "<tool",
    ):
        assert read_reply(text, TOOLS, HERMES, "r") == {"role": "assistant", "content": text}


def test_without_parallel_calls_only_the_first_counts():
    single = ToolUse(TOOLS.specs, parallel=False)
    message = read_reply(REPLY, single, HERMES, "r")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_a_llama3_reply_that_is_a_json_call_is_a_call():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'
    content, calls, _ = streamed(text, 3, syntax=LLAMA3_JSON)
    assert content == ""
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a":1,"b":2}'}
    assert read_reply("The answer is 3.", TOOLS, LLAMA3_JSON, "r")["content"] == "The answer is 3."
    two = '{"name": "add", "parameters": {"a": ";"}}; {"name": "get_weather", "parameters": {"q": "SELECT 1;"}}'
    message = read_reply(two, TOOLS, LLAMA3_JSON, "r")
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"a":";"}', '{"q":"SELECT 1;"}']


def test_tool_choice_none_reads_no_calls():
    none = ToolUse(TOOLS.specs, choice="none")
    assert read_reply(REPLY, none, HERMES, "r") == {"role": "assistant", "content": REPLY}


def test_a_template_says_whether_it_renders_tools_and_how_calls_look():
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}").native is False
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == tool_format("{{ tools }} <tool_call>")
    assert tool_format("{% if tools %}<tool_call>{% endif %}").syntax is HERMES
    assert tool_format('{{ tools }} "parameters" <|python_tag|>').syntax is LLAMA3_JSON


def test_a_tokenizer_with_named_templates_uses_the_one_transformers_would():
    # transformers keeps a model's several templates as a dict (Hermes-2-Pro, Command-R)
    named = SimpleNamespace(chat_template={"default": "{{ messages }}", "tool_use": "{{ tools }} <tool_call>"})
    assert chat_template(named, None) == "{{ messages }}"
    assert chat_template(named, TOOLS) == "{{ tools }} <tool_call>"
    assert model_tool_format(named, TOOLS).native is True
    assert model_tool_format(named, None).native is False


FORCED = ToolUse(TOOLS.specs, choice="required")
WHOLE = '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>'


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(
    ("text", "tools", "syntax", "content", "calls", "is_cut"),
    [  # a reply max_tokens cut inside a call block: the call so far when its name is whole, else nothing
        ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Par', FORCED, HERMES, "",
         [("get_weather", '{"city":"Par')], True),
        ('Let me check. <tool_call>\n{"name": "add", "arguments": {"a": 1', TOOLS, HERMES, "Let me check. ",
         [("add", '{"a": 1')], True),
        ('<tool_call>\n{"name":"add",', FORCED, HERMES, "", [("add", "")], True),
        ('Let me check. <tool_call>\n{"name": "get_wea', TOOLS, HERMES, "Let me check. ", [], False),
        ('a <tool_call>{bad}</tool_call> b <tool_call>{"name": "rm", "arguments": {', TOOLS, HERMES,
         "a <tool_call>{bad}</tool_call> b ", [], False),
        ("<tool_", FORCED, HERMES, "", [], False),
        ('<tool_call>{"name":"add","arguments":{"a":1}}\n', TOOLS, HERMES, "", [("add", '{"a":1}')], False),
        (WHOLE + '\n<tool_call>{"name":"get_weather","arguments":{"ci', FORCED, HERMES, "",
         [("add", '{"a":1}'), ("get_weather", '{"ci')], True),
        ('{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"b": ', TOOLS, LLAMA3_JSON, "",
         [("add", '{"a":1}'), ("add", '{"b": ')], True),
        ('{"name":"ad', FORCED, LLAMA3_JSON, "", [], False),
    ],
)  # fmt: skip
def test_a_block_the_reply_ended_inside_is_a_call_cut_short_or_nothing(
    size, text, tools, syntax, content, calls, is_cut
):
    streamed_content, streamed_calls, message = streamed(text, size, tools, syntax)
    assert streamed_content == content  # never the block's markup
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed_calls] == calls
    reader = ToolReader(tools, syntax, "req")
    assert reader.read_all(text) == message  # whole or streamed: one answer, the one the session records
    assert reader.is_cut is is_cut


def test_without_parallel_calls_a_cut_second_call_is_dropped():
    single = ToolUse(TOOLS.specs, choice="required", parallel=False)
    reader = ToolReader(single, HERMES, "r")
    message = reader.read_all(WHOLE + '\n<tool_call>{"name":"add","arguments":{"a":')
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"a":1}']
    assert not reader.is_cut


def test_a_forced_calls_schema_is_closed_and_its_strings_bounded_where_it_says_nothing():
    item = {"type": "object", "properties": {"sku": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
            "extra": {"type": "object", "additionalProperties": True},
            "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]},
            "both": {"allOf": [{"properties": {"x": {"type": "integer"}}}, {"properties": {"y": {"type": "integer"}}}]},
        },
        "required": ["name", "undeclared"],
        "$defs": {"Item": item},
    }
    forced = forced_arguments(schema)
    assert forced["additionalProperties"] is False
    assert forced["properties"]["undeclared"] == {}  # required but not described: any value, not unsatisfiable
    assert forced["properties"]["name"]["maxLength"] == MAX_FORCED_STRING
    assert "maxLength" not in forced["properties"]["code"]  # a pattern bounds it as it wants
    assert forced["$defs"]["Item"]["additionalProperties"] is False  # nested and referenced schemas too
    assert forced["$defs"]["Item"]["properties"]["sku"]["maxLength"] == MAX_FORCED_STRING
    assert forced["properties"]["extra"]["additionalProperties"] is True  # what a schema says is kept
    assert forced["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert all("additionalProperties" not in part for part in forced["properties"]["both"]["allOf"])
    assert "additionalProperties" not in schema  # the request's own schema is left as it is


def test_numbers_past_a_float_and_non_json_constants_never_break_an_answer():
    """A float past its range would become inf, which no JSON answer can hold (a 500 writing it): such a number
    stays exact, as an int, up to the digits an answer can write; NaN is no JSON and 1e999999999 no number to
    hold, so a block holding one is no call."""
    whole = read_reply('<tool_call>{"name":"add","arguments":{"a":1e999,"b":2.5}}</tool_call>', TOOLS, HERMES, "r")
    arguments = whole["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments, parse_constant=float) == {"a": 10**999, "b": 2.5}
    assert "Infinity" not in arguments
    assert tool_input(arguments) == {"a": 10**999, "b": 2.5}
    cut = read_reply('<tool_call>{"name":"add","arguments":{"a":-2E+999,"b":', FORCED, HERMES, "r")
    assert tool_input(cut["tool_calls"][0]["function"]["arguments"]) == {"a": -2 * 10**999}
    for number in ("NaN", "1e999999999"):  # no JSON; a number of a billion digits (its int would never finish)
        text = f'<tool_call>{{"name":"add","arguments":{{"a":{number}}}}}</tool_call>'
        assert read_reply(text, TOOLS, HERMES, "r") == {"role": "assistant", "content": text}
        assert tool_input(f'{{"b":1,"a":{number}}}') == {}  # text that is no JSON gives no input


# -- a tool response the model writes is never content ----------------------------------------
ECHO = 'It is <tool_response>\n{"sky": "clear", "temp": 21}\n</tool_response> sunny.'


@pytest.mark.parametrize("tools", [TOOLS, None, ToolUse(TOOLS.specs, choice="none")], ids=["tools", "none", "off"])
@pytest.mark.parametrize(
    ("text", "content"),
    [
        (ECHO, "It is  sunny."),
        ("<tool_response>\n{}\n</tool_response>", ""),  # a reply that only imitates a tool result: no answer
        ("Sunny. <tool_response>\n{}\n</tool_resp", "Sunny. "),  # ended inside it: none of it
        ("a <tool_response>x</tool_response> b <tool_response>y</tool_response>", "a  b "),
        ("<tool_respon is not a tag", "<tool_respon is not a tag"),
        ("a </tool_response> b", "a </tool_response> b"),  # a closing tag alone hides nothing
    ],
)
def test_a_tool_response_the_model_writes_is_dropped_in_every_split(tools, text, content):
    for streamed_content, calls, message in split_everywhere(lambda: ToolReader(tools, HERMES, "r", True), text):
        assert streamed_content == content
        assert not calls
        assert message == read_reply(text, tools, HERMES, "r", True) == {"role": "assistant", "content": content}


def test_a_tool_response_beside_a_call_is_dropped_and_the_call_read():
    text = '<tool_response>{"a": 1}</tool_response>Again: ' + WHOLE
    for content, calls, message in split_everywhere(lambda: ToolReader(TOOLS, HERMES, "r", True), text):
        assert content == "Again: "
        assert [c["function"]["arguments"] for c in calls] == ['{"a":1}']
        assert message == read_reply(text, TOOLS, HERMES, "r", True)


def test_a_tool_response_is_content_where_the_prompt_holds_none():
    assert read_reply(ECHO, TOOLS, HERMES, "r") == {"role": "assistant", "content": ECHO}
    generic = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenizer = SimpleNamespace(chat_template=generic, all_special_ids=[], added_tokens_decoder={})
    tokenizer.convert_tokens_to_ids = lambda token: None
    result = [{"role": "tool", "tool_call_id": "c", "content": "{}"}]
    assert Reading.of(tokenizer, TOOLS, "r", [{"role": "user", "content": "Hi"}, *result]).hides_responses
    assert not Reading.of(tokenizer, TOOLS, "r", [{"role": "user", "content": "Hi"}]).hides_responses
    llama = SimpleNamespace(**{**vars(tokenizer), "chat_template": '{{ tools }} "parameters" <|python_tag|> ipython'})
    assert not Reading.of(llama, TOOLS, "r", result).hides_responses  # its template wraps results otherwise


def test_the_engine_keeps_a_tool_response_from_opening_a_line_only_where_the_reader_hides_one():
    generic = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenizer = SimpleNamespace(chat_template=generic, all_special_ids=[], added_tokens_decoder={})
    tokenizer.convert_tokens_to_ids = lambda token: None
    result = [{"role": "tool", "tool_call_id": "c", "content": "{}"}]
    asked = [{"role": "user", "content": "Hi"}]
    assert Reading.of(tokenizer, TOOLS, "r", [*asked, *result]).banned_openings == ("<tool_response>",)
    assert Reading.of(tokenizer, None, "r", [*asked, *result]).banned_openings == ("<tool_response>",)
    assert Reading.of(tokenizer, TOOLS, "r", asked).banned_openings == ()  # no tool result: nothing to echo
    llama = SimpleNamespace(**{**vars(tokenizer), "chat_template": '{{ tools }} "parameters" <|python_tag|> ipython'})
    assert Reading.of(llama, TOOLS, "r", result).banned_openings == ()


# -- a forced reply that repeats a call ends there ---------------------------------------------
def test_a_forced_reply_ends_at_its_first_repeated_call():
    other = '<tool_call>{"name":"add","arguments":{"a":2}}</tool_call>'
    respaced = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'  # the same call, written otherwise
    text = "\n".join([WHOLE, other, respaced, other])
    for content, calls, message in split_everywhere(lambda: ToolReader(FORCED, HERMES, "r"), text):
        assert content == ""
        assert [c["function"]["arguments"] for c in calls] == ['{"a":1}', '{"a":2}']  # nothing from the repeat on
        assert message == read_reply(text, FORCED, HERMES, "r")
    assert [c["function"]["arguments"] for c in read_reply(text, TOOLS, HERMES, "r")["tool_calls"]] == [
        '{"a":1}',
        '{"a":2}',
        '{"a":1}',
        '{"a":2}',
    ]  # auto is read as written: only a forced reply is the grammar's doing


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3_JSON])
def test_the_engine_is_told_to_end_a_forced_reply_when_a_call_repeats(syntax):
    call = '{"name":"add","arguments":{"a":1}}' if syntax is HERMES else '{"name":"add","parameters":{"a":1}}'
    block = f"<tool_call>\n{call}\n</tool_call>" if syntax is HERMES else call
    separator = "\n" if syntax is HERMES else ";"
    text = block + separator + block + separator
    for parallel, expected in ((True, True), (False, None)):
        reading = Reading(ToolUse(TOOLS.specs, choice="required", parallel=parallel), syntax, "r")
        assert reading.watches_repeats is bool(expected)
        if not reading.watches_repeats:
            continue
        is_over = reading.watch()
        ends = [at for at in range(1, len(text) + 1) if is_over(text[at - 1])]
        assert ends[0] == 2 * len(block) + len(separator)  # the character that closes the repeated call
    assert not Reading(TOOLS, HERMES, "r").watches_repeats  # auto: the model's own choice


# -- an open object in a forced call: any object, bounded ----------------------------------------
def accepts(grammars: Grammars, tiny, grammar: str, text: str) -> bool:
    constraint = grammars.compile(Grammars.lark(grammar))
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(constraint.consume(i) for i in ids) and bool(constraint.matcher.is_accepting())


def test_a_forced_call_takes_any_object_where_the_schema_says_nothing_of_its_keys(tiny):
    grammars = Grammars(tiny.tokenizer, tiny.vocab_size, tiny.eos_ids)
    search = ToolUse((ToolSpec("search", None, {"type": "object"}),), choice="required")
    grammar = tool_grammar(search, HERMES)

    def call(arguments: str) -> str:
        return f'<tool_call>\n{{"name":"search","arguments":{arguments}}}\n</tool_call>'

    deep = '{"a":{"b":{"c":{"d":1}}}}'
    for arguments in (
        "{}",
        '{"query":"tallest mountain","limit":3}',
        '{"filters":{"lang":["en","fr"]},"x":null}',
        deep,
    ):
        assert accepts(grammars, tiny, grammar, call(arguments)), arguments
    many = json.dumps({f"k{i}": i for i in range(MAX_OPEN_MEMBERS + 1)}, separators=(",", ":"))
    too_deep = '{"a":{"b":{"c":{"d":{}}}}}'
    for arguments in (many, json.dumps({"k" * 65: 1}), json.dumps({"q": "x" * (MAX_FORCED_STRING + 1)}), too_deep):
        assert not accepts(grammars, tiny, grammar, call(arguments)), arguments[:80]
    # Objects that name their keys stay closed to them; one that names none (no parameters) is {} alone.
    closed = ToolUse(
        (ToolSpec("search", None, {"type": "object", "properties": {"q": {"type": "string"}}}),), "required"
    )
    assert accepts(grammars, tiny, tool_grammar(closed, HERMES), call('{"q":"x"}'))
    assert not accepts(grammars, tiny, tool_grammar(closed, HERMES), call('{"q":"x","more":1}'))
    bare = ToolUse((ToolSpec("search", None, {"type": "object", "properties": {}}),), "required")
    assert accepts(grammars, tiny, tool_grammar(bare, HERMES), call("{}"))
    assert not accepts(grammars, tiny, tool_grammar(bare, HERMES), call('{"q":"x"}'))
    # After one or more calls the reply may end (the grammar accepts there), with parallel calls or without.
    assert accepts(grammars, tiny, grammar, call("{}") + "\n" + call('{"q":1}'))
