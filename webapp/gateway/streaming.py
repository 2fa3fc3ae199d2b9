"""``stream: true`` chat completions, sent token by token as the engine produces them.

Each choice's tokens arrive from the engine's streaming ``/generate`` and are decoded as
they come (``ChoiceText``). Only text goes out as a content delta: the stop token never
(its logprob is not sent either), and neither is what may still turn out to be markup.
Text that could begin a stop string or a ``<tool_call>`` is held back until the next
tokens decide it; once a ``<tool_call>`` opens, the rest of the choice is held until the
generation ends and goes out as OpenAI ``tool_calls`` deltas. With ``logprobs`` each
chunk carries the entries of the tokens whose text that chunk completes.

Durability is as for a non-streamed turn: the turn is recorded (``turns.record``) after
the last token and before the finish chunks, the usage chunk and ``data: [DONE]``. A
client that goes away mid-stream (the ASGI route cancels the stream, or closes it when a
send fails) gets its generation aborted on the engine (``abort_request`` by rid) and its
turn recorded with ``"aborted": true`` on its outputs: kept for inspection, never trained
(``selectors.session_trajectories`` leaves it out) and never replayed to a retry. With traces
on, the stream ends the turn's engine span after the last token, spans the record, and ends
the trace (``webapp.gateway.traces``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson

from rl_core.chat import TOOL_CALL_RE, parse_tool_calls
from rl_core.inference.client import GenerateChunk, InferenceError
from rl_core.tracing import Trace
from webapp.gateway import traces, turns
from webapp.gateway.chat_request import ChatRequest
from webapp.gateway.errors import GatewayError
from webapp.gateway.inference import StreamingGeneration
from webapp.gateway.replies import matched_stop, storable_text

TOOL_CALL_OPEN = "<tool_call>"
# Recorded in place of the request's fingerprint: an aborted turn is never replayed to a retry.
ABORTED_REQUEST_HASH = ""


class ChoiceText:
    """One choice's tokens and text as they arrive, and how much of them was sent."""

    def __init__(self, tok, chat: ChatRequest):
        self.tok = tok
        self.stops = [s for s in chat.stop if s]
        self.openers = self.stops + ([TOOL_CALL_OPEN] if chat.rendered_tools else [])
        self.tools = bool(chat.rendered_tools)
        self.top_n = chat.top_logprobs
        self.want_logprobs = bool(chat.logprobs)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.top: list[list[tuple[float, int]]] = []
        self.ends: list[int] = []  # where each token's text ends in ``text``
        self.text = ""
        self.prefix = self.read = 0  # the decoding window (``_decode``)
        self.sent = 0  # characters of ``text`` sent as content
        self.sent_tokens = 0  # tokens whose logprob entries were sent
        self.finish: str | None = None
        self.stop_token = False  # the last token is the stop token: neither text nor logprob
        self.matched_stop: str | int | None = None  # what the engine says ended it

    def add(self, chunk: GenerateChunk) -> None:
        if self.want_logprobs:  # each token's own end, for the chunk that sends its entry
            for token in chunk.output_ids:
                self.ids.append(token)
                self.ends.append(-1)  # until its text is decoded
                self._decode(final=False)
        elif chunk.output_ids:  # the tokens that arrived together are decoded together
            self.ids += chunk.output_ids
            self.ends += [-1] * len(chunk.output_ids)
            self._decode(final=False)
        self.logprobs += chunk.output_logprobs
        self.versions += chunk.versions
        if chunk.revised_versions is not None:
            self.versions = list(chunk.revised_versions)
        if chunk.top_logprobs:
            self.top += chunk.top_logprobs
        if chunk.finish_reason is not None:
            self._decode(final=True)
            self.finish = chunk.finish_reason
            self.matched_stop = chunk.matched_stop
            self.stop_token = (
                chunk.finish_reason == "stop"
                and isinstance(chunk.matched_stop, int)
                and bool(self.ids)
                and self.ids[-1] == chunk.matched_stop
            )

    def _decode(self, *, final: bool) -> None:
        """Extend ``text`` by what the newest tokens complete.

        Incremental detokenization as vLLM's: the tokens since ``prefix`` are decoded, and
        what they add to the text of ``prefix:read`` is new; a short window instead of the
        whole answer per token, which would be quadratic in its length. A token that ends
        inside a character (it decodes to U+FFFD) waits for the next, except at the end.
        """
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += storable_text(after[len(before) :])
        elif not final:
            return
        for k in range(self.read, len(self.ids)):  # the tokens that waited end here
            self.ends[k] = len(self.text)
        self.prefix, self.read = self.read, len(self.ids)

    def _cut(self) -> int | None:
        """Where the content ends for sure: the first stop string or tool-call opener."""
        return _first(self.text, self.openers, self.sent)

    def _stop_cut(self) -> int:
        cut = _first(self.text, self.stops, self.sent)
        return len(self.text) if cut is None else cut

    def sendable(self) -> int:
        """How much of the text can go out now, without what the next tokens may change."""
        cut = self._cut()
        if cut is not None:
            return max(cut, self.sent)
        end = len(self.text)
        while end > self.sent and self.text[end - 1] == "\ufffd":  # an unfinished character
            end -= 1
        held = 0
        for opener in self.openers:
            for k in range(min(len(opener) - 1, end - self.sent), held, -1):
                if self.text.endswith(opener[:k], 0, end):
                    held = k
                    break
        return end - held

    def step(self, final: bool) -> tuple[str, list[dict] | None]:
        """The content to send now and, with logprobs, the entries of the tokens it completes."""
        if final:
            end = self._stop_cut()
            if self.tools and TOOL_CALL_OPEN in self.text[:end]:
                end = max(self.sent, self.text.find(TOOL_CALL_OPEN))
        else:
            end = self.sendable()
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece, self._entries(final) if self.want_logprobs else None

    def _entries(self, final: bool) -> list[dict]:
        last = len(self.ids) - (1 if self.stop_token else 0)
        entries = []
        while self.sent_tokens < last:
            k = self.sent_tokens
            end, start = self.ends[k], self.ends[k - 1] if k else 0
            # A token goes with the chunk that completes its text; at the end, every token
            # that began inside the content goes too, the markup's and the stop token's do not.
            if end < 0 or not (end <= self.sent or (final and start < self.sent)):
                break
            entries.append(self._entry(k))
            self.sent_tokens += 1
        return entries

    def _entry(self, k: int) -> dict:
        text = self.tok.token_text(self.ids[k])
        entry: dict[str, Any] = {
            "token": storable_text(text),
            "logprob": self.logprobs[k],
            "bytes": list(text.encode()),
            "top_logprobs": [],
        }
        if self.top_n and k < len(self.top):
            for top_lp, top_id in self.top[k][: self.top_n]:
                top_text = self.tok.token_text(top_id)
                entry["top_logprobs"].append(
                    {
                        "token": storable_text(top_text),
                        "logprob": top_lp,
                        "bytes": list(top_text.encode()),
                    }
                )
        return entry

    def tool_calls(self) -> tuple[list[dict], str]:
        """At the end: the parsed calls, and the text around them still to send as content."""
        if not self.tools:
            return [], ""
        tail = self.text[self.sent : self._stop_cut()]
        if TOOL_CALL_OPEN not in tail:
            return [], ""
        _, calls = parse_tool_calls(tail)
        if not calls:  # malformed markup stays text, as in a non-streamed answer
            return [], tail
        return calls, TOOL_CALL_RE.sub("", tail).strip()

    def output(self, *, aborted: bool = False) -> dict:
        """What is recorded for the choice (as a non-streamed turn's, plus ``aborted``)."""
        out = {
            "output_ids": self.ids,
            "logprobs": self.logprobs,
            "versions": self.versions,
            "finish_reason": "abort" if aborted else self.finish,
            "text": self.text[: self._stop_cut()],
        }
        if aborted:
            out["aborted"] = True
        return out


class CompletionStream:
    """The SSE body of one streamed completion; iterate ``events()``."""

    def __init__(
        self,
        *,
        chat: ChatRequest,
        tok,
        generation: StreamingGeneration,
        interaction_id: str,
        model: str,
        record: dict,
        started: float,
        turn: turns.Turn,
        db,
        trace: Trace | None = None,
    ):
        self.chat, self.generation, self.turn, self.db = chat, generation, turn, db
        self.trace = trace
        if trace is not None:
            trace.ends_later = True  # by ``events``
        self.interaction_id, self.model = interaction_id, model
        self.created = int(time.time())
        self.record_args, self.started = record, started
        self.choices = [ChoiceText(tok, chat) for _ in range(chat.n)]
        self.sent_logprobs: list[list[dict]] = [[] for _ in range(chat.n)]
        self.content: list[str] = ["" for _ in range(chat.n)]
        self.fingerprint = f"steep-v{generation.version}"
        self._frames: dict[int, tuple[bytes, bytes] | None] = {}  # ``_content_frame``

    def _chunk(self, choices: list[dict], usage: Any = None) -> bytes:
        body = {
            "id": self.interaction_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if self.chat.include_usage:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _delta(self, index: int, delta: dict, logprobs=None, finish=None, **more) -> bytes:
        lp = {"content": logprobs, "refusal": None} if logprobs is not None else None
        return self._chunk(
            [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish, **more}]
        )

    def _content(self, index: int, piece: str, entries: list[dict] | None) -> bytes | None:
        self.content[index] += piece
        send_lp = self.chat.logprobs and bool(entries)
        if send_lp:
            self.sent_logprobs[index] += entries or []
        if not piece and not send_lp:
            return None
        if send_lp:
            return self._delta(index, {"content": piece}, entries)
        # The common chunk, once per token: the same bytes as ``_delta`` would build, but
        # from a prefix and suffix made once per stream.
        frame = self._content_frame(index)
        if frame is None:
            return self._delta(index, {"content": piece})
        return frame[0] + orjson.dumps(piece) + frame[1]

    def _content_frame(self, index: int) -> tuple[bytes, bytes] | None:
        if index not in self._frames:
            marker = orjson.dumps("\x00")  # marks where the content goes
            parts = self._delta(index, {"content": "\x00"}).split(marker)
            # None (build each chunk whole) if the marker is also elsewhere, e.g. in the model
            self._frames[index] = (parts[0], parts[1]) if len(parts) == 2 else None
        return self._frames[index]

    async def events(self):
        """Role chunks, content deltas as tokens arrive, then the recorded finish, usage, [DONE]."""
        recorded = False
        error: BaseException | None = None  # how the stream ended, for its trace
        try:
            # The role chunks go out with the first content: one write less before the first token.
            head = b"".join(
                self._delta(index, {"role": "assistant", "content": ""})
                for index in range(self.chat.n)
            )
            async for index, chunk in self.generation.chunks():
                choice = self.choices[index]
                choice.add(chunk)
                event = self._content(index, *choice.step(chunk.finish_reason is not None))
                if event is not None:
                    yield head + event
                    head = b""
            if head:
                yield head
            if self.trace is not None:
                traces.engine_ends(
                    self.trace,
                    self.generation.server_url,
                    [(len(choice.ids), choice.finish) for choice in self.choices],
                )
            calls = []
            for index, choice in enumerate(self.choices):
                found, extra = choice.tool_calls()
                calls.append(found)
                if extra:
                    yield self._delta(index, {"content": extra})
                    self.content[index] += extra
            response = await self._record(calls)
            recorded = True
            # Everything after the record goes out in one write: it is all known at once.
            tail = [
                self._delta(index, {"tool_calls": [{"index": position, **call}]})
                for index, found in enumerate(calls)
                for position, call in enumerate(found)
            ]
            tail += [  # with ``matched_stop``, as SGLang's last chunk
                self._delta(
                    choice["index"],
                    {},
                    finish=choice["finish_reason"],
                    matched_stop=choice["matched_stop"],
                )
                for choice in response["choices"]
            ]
            if self.chat.include_usage:
                tail.append(self._chunk([], usage=response["usage"]))
            tail.append(b"data: [DONE]\n\n")
            yield b"".join(tail)
        except (asyncio.CancelledError, GeneratorExit) as exc:
            if not recorded:  # the client went away: abort on the engine, keep the turn
                error = exc
                await asyncio.shield(self._abort())
            raise
        except (GatewayError, InferenceError) as exc:
            error = exc
            if not recorded and self.turn.opened:
                await asyncio.shield(self.db(turns.discard(turn=self.turn), durable=False))
            failure = exc if isinstance(exc, GatewayError) else _engine_error(exc)
            yield b"data: " + orjson.dumps(failure.payload()[1]) + b"\n\n"
        finally:
            if self.trace is not None:
                traces.stream_ended(self.trace, error)

    def _response(self, calls: list[list[dict]], *, aborted: bool = False) -> dict:
        choices, completion_tokens = [], 0
        for index, choice in enumerate(self.choices):
            content, found = self.content[index], calls[index]
            message: dict[str, Any] = {
                "role": "assistant",
                "content": content if content or not found else None,
            }
            if found:
                message["tool_calls"] = found
            finish = (
                "abort"
                if aborted
                else "tool_calls"
                if found
                else ("length" if choice.finish in ("length", "abort") else "stop")
            )
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "finish_reason": finish,
                    "matched_stop": matched_stop(choice.text, choice.stops, choice.matched_stop)
                    if finish == "stop"
                    else None,
                    "logprobs": {"content": self.sent_logprobs[index], "refusal": None}
                    if self.chat.logprobs
                    else None,
                }
            )
            completion_tokens += len(choice.ids)
        prompt_tokens = len(self.record_args["input_ids"])
        return {
            "id": self.interaction_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    async def _record(self, calls: list[list[dict]], *, aborted: bool = False) -> dict:
        response = self._response(calls, aborted=aborted)
        args = dict(self.record_args)
        if aborted:
            args["request_hash"] = ABORTED_REQUEST_HASH
        if self.trace is not None:
            self.trace.begin("steep.turn.record")
        recorded = await self.db(
            turns.record(
                turn=self.turn,
                interaction_id=self.interaction_id,
                outputs=[c.output(aborted=aborted) for c in self.choices],
                response=response,
                server_url=self.generation.server_url,
                latency_ms=(time.perf_counter() - self.started) * 1000,
                **args,
            )
        )
        if self.trace is not None:
            traces.recorded(self.trace, response)
        turns.remember(self.turn, recorded)  # committed: the session's next turn may start from it
        return response

    async def _abort(self) -> None:
        await self.generation.abort()
        try:
            await self._record([[] for _ in self.choices], aborted=True)
        except GatewayError:  # e.g. the session ended meanwhile: nothing left to keep it in
            if self.turn.opened:
                with contextlib.suppress(GatewayError):
                    await self.db(turns.discard(turn=self.turn), durable=False)


def _first(text: str, needles: list[str], start: int) -> int | None:
    # Nothing sent can hold the start of one (it was held back), so the search starts there:
    # a scan of the new text per token, not of the whole answer.
    found = [at for at in (text.find(needle, start) for needle in needles) if at >= 0]
    return min(found) if found else None


def _engine_error(exc: InferenceError) -> GatewayError:
    return GatewayError(
        502, f"The inference server failed mid-stream: {exc}", code="inference_error"
    )
