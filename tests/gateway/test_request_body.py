"""A request body holding text no database can store (NUL, a lone surrogate) is refused however
it spells it; every other body is parsed as ``json.loads`` parses it
(``chat_request.parse_json_body``, which skips the walk over every value when the raw bytes
cannot hold such text)."""

from __future__ import annotations

import json

import pytest

from webapp.gateway.chat_request import parse_json_body
from webapp.gateway.errors import GatewayError

UNSTORABLE = [
    b'{"content": "a\\u0000b"}',
    b'{"content": "\\ud800"}',
    b'{"content": "\\uDFFF x"}',
    b'{"a\\u0000": 1}',  # a key
    '{"content": "\ud800"}'.encode("utf-8", "surrogatepass"),  # raw surrogate bytes
    '{"content": "\ud800"}'.encode("utf-16", "surrogatepass"),  # UTF-16 with a byte order mark
    '{"content": "\ud800"}'.encode("utf-16-le", "surrogatepass"),  # and without
    '{"content": "a\\u0000"}'.encode("utf-32"),
    b'\xef\xbb\xbf{"content": "\\u0000"}',  # UTF-8 with a byte order mark
]

STORABLE = [
    b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}',
    '{"content": "Ça fait 4 😀, 한국어 \\u00e9 \\ud83d\\ude00"}'.encode(),
    '{"content": "Ça"}'.encode("utf-16"),
    b'{"content": "a\\\\u0000"}',  # an escaped backslash, then text
    b"[1, 2.5, null, true]",
    b"",
]


@pytest.mark.parametrize("body", UNSTORABLE)
def test_a_body_with_text_no_database_can_hold_is_400(body):
    with pytest.raises(GatewayError) as refused:
        parse_json_body(body, "application/json")
    assert refused.value.status == 400 and refused.value.code == "invalid_value"


@pytest.mark.parametrize("body", STORABLE)
def test_any_other_body_parses_as_json_loads_does(body):
    assert parse_json_body(body, "application/json") == json.loads(body or b"null")
