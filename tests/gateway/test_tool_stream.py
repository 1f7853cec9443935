"""Tool calls read as the answer grows (gateway/tool_stream.py) and streamed as deltas
(gateway/tool_output.py): whatever the pieces the text arrives in, a call's name goes out once it
is complete, its arguments' pieces join to the text written, and the whole answer reads the same
as when it is parsed at once (calls cut by max_tokens included). The layout is the tools
grammar's (tests/api/test_api_tools.py runs it through a real server)."""

import json
import random

import pytest
from cde.gateway.structured_schemas import NamedToolChoice
from cde.gateway.tool_output import StreamedAnswer, answer_message
from cde.gateway.tool_stream import CallReader

ARGS = [
    '{"city":"Paris","unit":"C"}',
    '{"q":"a}\\"b{[","n":[1,{"x":[]}],"ok":true}',  # brackets and an escaped quote inside strings
    "{}",
]
NAMES = ["get_weather", "search", "noop"]
ANSWER = "".join(f'<tool_call>{{"name":"{n}","arguments":{a}}}</tool_call>' for n, a in zip(NAMES, ARGS))


def pieces(text: str, seed: int) -> list[str]:
    rng, out, pos = random.Random(seed), [], 0
    while pos < len(text):
        step = rng.choice([1, 1, 2, 3, 7, 20])
        out.append(text[pos : pos + step])
        pos += step
    return out


@pytest.mark.parametrize("seed", range(12))
def test_calls_read_in_any_pieces_are_the_calls_read_at_once(seed):
    reader, names, args, ids = CallReader(), {}, {}, {}
    for piece in pieces(ANSWER, seed) if seed else list(ANSWER):
        for part in reader.feed(piece):
            if part.name is not None:
                assert part.index == len(names) and part.index not in args  # a name before its arguments
                names[part.index], ids[part.index] = part.name, part.id
            args[part.index] = args.get(part.index, "") + part.arguments
    assert reader.calls_whole and not reader.broken
    assert [names[i] for i in range(3)] == NAMES and [args[i] for i in range(3)] == ARGS
    whole = answer_message(ANSWER, "stop", tools=True)[0].tool_calls
    assert [(c.function.name, c.function.arguments) for c in whole] == list(zip(NAMES, ARGS))
    assert len({c.id for c in whole} | set(ids.values())) == 6 and all(i.startswith("call_") for i in ids.values())


def test_arguments_go_out_before_the_call_is_closed():
    reader = CallReader()
    assert reader.feed('<tool_call>{"name":"get_we') == []
    head, first = reader.feed('ather","arguments":{"ci')
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "") and head.id.startswith("call_")
    assert (first.index, first.name, first.arguments) == (0, None, '{"ci')
    (more,) = reader.feed('ty":"Pa')
    assert more.arguments == 'ty":"Pa' and not reader.calls_whole
    (last,) = reader.feed('ris"}}</tool_call>')
    assert last.arguments == 'ris"}' and reader.calls_whole


def stream(text_pieces, finish, choice=None):
    answer, deltas = StreamedAnswer(tools=True, choice=choice), []
    text_pieces = text_pieces or [""]  # no text: the engine's last delta carries the finish alone
    for i, piece in enumerate(text_pieces):
        deltas.append(answer.delta(piece, finish if i == len(text_pieces) - 1 else None))
    return deltas


def joined(deltas) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) that a stream's deltas join to."""
    texts, calls = [d.content for d, _ in deltas if d.content is not None], {}
    for d, _ in deltas:
        for t in d.tool_calls or []:
            name, arguments = calls.get(t.index, ("", ""))
            calls[t.index] = (name + (t.function.name or ""), arguments + t.function.arguments)
    return "".join(texts) if texts else None, [calls[i] for i in sorted(calls)], deltas[-1][1]


@pytest.mark.parametrize(
    "text",
    [
        ANSWER,
        '<tool_call>{"name":"a","arguments":{"x":1}}',  # not closed
        '<tool_call>{"name":"a","arguments":{"x":1',  # cut inside the arguments
        '<tool_call>{"name":"a","arguments":{}}</tool_call><tool_call>{"name":"b","',  # the second cut before its name
        '<tool_call>{"name":"a","arguments":{}}</tool_call><tool_c',  # a second call cut at its start
        '<tool_call>{"name":"a"',  # cut right after its name: a call with no arguments yet
        '<tool_call>{"name":"a","argu',  # cut inside the layout between the name and the arguments
        '<tool_call>{"na',  # cut before a name is complete: text
        '<tool_call>{"arguments":{},"name":"a"}</tool_call>',  # not the grammar's layout: text
        "<tool_c",
        "Hello",
        "",  # ended before a token: a text answer, "" as unstreamed (a streamed role with tools has no content)
    ],
)
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_a_whole_answer_is_what_its_stream_joins_to(text, finish):
    """Streamed or not, an answer reads the same: calls cut by max_tokens are calls in both."""
    message, whole_finish = answer_message(text, finish, tools=True)
    calls = [(t.function.name, t.function.arguments) for t in message.tool_calls or []]
    for seed in range(4):
        assert joined(stream(pieces(text, seed), finish)) == (message.content, calls, whole_finish)


def test_a_streamed_answer_of_calls_joins_to_the_whole_answer():
    deltas = stream(pieces(ANSWER, 5), "stop")
    assert [f for _, f in deltas[:-1]] == [None] * (len(deltas) - 1) and deltas[-1][1] == "tool_calls"
    assert all(d.content is None for d, _ in deltas)
    calls: dict[int, dict] = {}
    for d, _ in deltas:
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, {"name": "", "arguments": ""})
            assert (t.id is not None) == (t.function.name is not None) == (entry["name"] == "")
            entry["name"] += t.function.name or ""
            entry["arguments"] += t.function.arguments
    assert [calls[i] for i in range(3)] == [{"name": n, "arguments": a} for n, a in zip(NAMES, ARGS)]
    message, finish = answer_message(ANSWER, "stop", tools=True)
    assert finish == "tool_calls" and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == list(zip(NAMES, ARGS))
    assert json.loads(message.tool_calls[1].function.arguments)["q"] == 'a}"b{['


def test_calls_cut_short_end_as_the_engine_ended_them():
    cut = '<tool_call>{"name":"get_weather","arguments":{"city":"Pa'
    deltas = stream([cut[:20], cut[20:]], "length")
    assert deltas[-1][1] == "length"
    assert "".join(t.function.arguments for d, _ in deltas for t in d.tool_calls or []) == '{"city":"Pa'
    # cut before the name is complete: nothing went out as a call, so the text goes out as text
    deltas = stream(['<tool_call>{"na', 'me":"get_w'], "length")
    assert deltas[-1] == (deltas[-1][0], "length") and deltas[-1][0].content == '<tool_call>{"name":"get_w'
    message, finish = answer_message(cut, "length", tools=True)
    assert finish == "length" and message.content is None
    assert [(t.function.name, t.function.arguments) for t in message.tool_calls] == [("get_weather", '{"city":"Pa')]
    # cut once the name is complete: a call, whose arguments are still to come
    for at_name in ('<tool_call>{"name":"get_weather"', '<tool_call>{"name":"get_weather","arguments'):
        message, finish = answer_message(at_name, "length", tools=True)
        assert finish == "length" and message.content is None
        assert [(t.function.name, t.function.arguments) for t in message.tool_calls] == [("get_weather", "")]


def test_calls_whose_closing_layout_a_stop_string_cut_finish_as_calls():
    """A stop string that cut only the layout after a call's arguments (`</tool_call>`, the next
    call's start) leaves whole calls: "tool_calls", as vLLM reports the calls it parsed; one that
    cut inside the arguments leaves the engine's "stop"."""
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}'
    nxt = call + "}</tool_call><tool_c"
    for text in (call, call + "}", call + "}</tool", nxt, nxt + 'all>{"na', nxt + 'all>{"name":"ge'):
        assert answer_message(text, "stop", tools=True)[1] == "tool_calls", text
        assert answer_message(text, "length", tools=True)[1] == "length", text
    # A next call whose name is closed is a call, its arguments still to come; one cut inside them too.
    for text in (nxt + 'all>{"name":"get_weather"', call[:-3]):
        assert answer_message(text, "stop", tools=True)[1] == "stop", text
    # max_tokens that ended the answer right after a closed call: an answer of calls.
    assert answer_message(call + "}</tool_call>", "length", tools=True)[1] == "tool_calls"


def test_text_answers_go_out_as_text():
    deltas = stream(["<", "tool", "s are", " fun"], "stop")
    assert "".join(d.content or "" for d, _ in deltas) == "<tools are fun" and deltas[-1][1] == "stop"
    deltas = stream(["<tool_c"], "stop")  # ended while it could still have been a call
    assert deltas[-1][0].content == "<tool_c" and deltas[-1][1] == "stop"


NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})


@pytest.mark.parametrize("choice,finish", [(None, "tool_calls"), ("required", "tool_calls"), (NAMED, "stop")])
def test_a_named_functions_call_ends_as_the_engine_ended_it(choice, finish):
    """OpenAI and vLLM: calls the model chose end "tool_calls"; the call of a function the request
    named ends "stop" (or "length", cut short), streamed or not."""
    call = '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>'
    assert [f for _, f in stream(pieces(call, 1), "stop", choice)][-1] == finish
    assert answer_message(call, "stop", tools=True, choice=choice)[1] == finish
    assert answer_message(call[:-3], "length", tools=True, choice=choice)[1] == "length"
