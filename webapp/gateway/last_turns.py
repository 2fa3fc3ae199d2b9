"""Each session's last turn as this web process recorded it, so its next turn need not read it back.

A chat turn on a session key continues the session's last turn: its messages, the prompt's and
the answers' token ids (``chat_request.PreviousTurn``), and its request hash and response (an SDK
retry of it gets that response again). ``turns.begin`` reads the session in one statement, and
read that turn's columns with it at every turn: the whole conversation as JSON, parsed again,
growing with every turn. A process that recorded the turn itself already holds all of it.

So after a turn is committed, the process keeps a copy under the session key's hash together
with the session's id and the turn count that commit left it at (``turns.remember``). The copy
is trusted only while the key still names that session at that count: ``turns.begin``'s
statement sends both and leaves the turn's columns out only when they match, so a turn another
web process (or the Django views in another thread) recorded since, or a new session the key
was rebound to (``/rl/start_session`` with a live session key), is read from its row, in the
same statement. The columns kept here are written once, with the turn, so a match means the
copy is the row.

Nothing here is the truth: a process may drop any entry (the least recently used go first,
past ``MAX_SESSIONS`` sessions or ``MAX_TOKEN_IDS`` token ids in all), and a missing copy costs
only the read it saves.
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from webapp.gateway.chat_request import PreviousTurn

MAX_SESSIONS = 4096
MAX_TOKEN_IDS = 2_000_000  # prompt and answer ids over all copies (tens of MB of Python ints)


@dataclass(frozen=True)
class KnownTurn:
    """A session's last turn as recorded here, valid while the session's count is ``count``."""

    session_id: uuid.UUID
    count: int  # the session's interaction_count once this turn was committed
    previous: PreviousTurn
    request_hash: str
    response: dict

    def holds(self, session_id: uuid.UUID, count: int) -> bool:
        """Whether this is the last turn of ``session_id`` at ``count`` turns."""
        return self.count == count and self.session_id == session_id

    @property
    def token_ids(self) -> int:
        return len(self.previous.input_ids) + sum(
            len(choice["output_ids"]) for choice in self.previous.choices
        )


class LastTurns:
    """Session key hash → its ``KnownTurn``, least recently used first out. Thread-safe: the
    lane's thread reads it, the event loop writes it."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_token_ids: int = MAX_TOKEN_IDS):
        self.max_sessions = max_sessions
        self.max_token_ids = max_token_ids
        self._turns: OrderedDict[str, KnownTurn] = OrderedDict()
        self._token_ids = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    @property
    def token_ids(self) -> int:
        return self._token_ids

    def get(self, key_hash: str) -> KnownTurn | None:
        with self._lock:
            known = self._turns.get(key_hash)
            if known is not None:
                self._turns.move_to_end(key_hash)
            return known

    def put(self, key_hash: str, known: KnownTurn) -> None:
        size = known.token_ids
        with self._lock:
            old = self._turns.get(key_hash)
            if old is not None and old.session_id == known.session_id and old.count > known.count:
                return  # a later turn of the session was remembered first: keep it
            if old is not None:
                del self._turns[key_hash]
                self._token_ids -= old.token_ids
            if size > self.max_token_ids:
                return
            self._turns[key_hash] = known
            self._token_ids += size
            while len(self._turns) > self.max_sessions or self._token_ids > self.max_token_ids:
                _, dropped = self._turns.popitem(last=False)
                self._token_ids -= dropped.token_ids


LAST_TURNS = LastTurns()
