"""A session's turns as a conversation tree: which turn continues which, retry orphans, branches.

Agents do not always talk in one straight line. An SDK retries a request whose first attempt
timed out (the gateway may have answered both), and parallel tool-calling sub-agents share one
session key, so their turns interleave. The rules, applied when a session becomes trajectories
(``selectors.session_trajectories``), off the gateway's hot path:

- **Parent.** A turn continues turn X when its messages begin with X's messages followed by one
  of X's answers (compared as ``normalize_message`` does). Of several such turns, the one with
  the longest conversation, and of equals the latest. A turn with no parent is a root (the
  first turn, a sub-agent's own conversation, or an agent that rewrote its history).
- **Retry orphans** (AReaL's ``drop_retry_orphans``). Turns with the same messages and tools are
  attempts at one request. When some attempt was continued, the attempts nobody continued are
  orphans: their answers never reached the conversation. When none was continued, the latest is
  kept. When several were continued, all are kept (real branches). Orphans are not trained.
- **Branches.** A turn continues its parent's branch while the parent is still that branch's
  last turn; a second continuation of the same turn (a fork: sub-agents spawned from one
  conversation) and a root start a new branch. Each branch is its own trajectory (or several,
  where the tokens do not line up: see ``selectors.session_trajectories``), so interleaved
  sub-agents never mix, and each turn is trained in exactly one trajectory.
- **Shared outcome.** The session's reward (the reward of its last turn, what ``set_reward``
  without an ``interaction_id`` sets) also rewards each other branch whose last turn has no
  reward of its own: sub-agents share the episode's outcome.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from webapp.gateway.chat_request import normalize_message


@dataclass(eq=False)
class Node:
    """One recorded turn in the tree."""

    turn: Any  # an Interaction (messages, tools, outputs, response, chosen, reward, ...)
    parent: Node | None = None
    continued_choice: int = 0  # which of the parent's choices this turn continues
    children: list[Node] = field(default_factory=list)

    @property
    def choice(self) -> int:
        """The choice the conversation continued with: its first child's, else the recorded one."""
        return self.children[0].continued_choice if self.children else int(self.turn.chosen)


def _digest(previous: str, item: Any) -> str:
    text = json.dumps(item, sort_keys=True, default=str)
    return hashlib.sha1(f"{previous}\x00{text}".encode()).hexdigest()


def _prefix_keys(messages: list) -> list[str]:
    """Key of every prefix of ``messages``: ``keys[k]`` identifies ``messages[: k + 1]``."""
    keys, key = [], ""
    for message in messages:
        key = _digest(key, normalize_message(message) if isinstance(message, dict) else message)
        keys.append(key)
    return keys


def conversation_tree(turns: list) -> list[Node]:
    """Nodes of ``turns`` (in turn order) with their parents and children filled in."""
    nodes = [Node(turn) for turn in turns]
    if all(_continues_previous(a, b) for a, b in zip(turns, turns[1:], strict=False)):
        # A straight conversation, as the gateway already found when it reused each previous
        # turn's tokens (and recorded the choice continued): no need to compare messages, and
        # no two turns can share their messages, so there are no retry orphans either.
        for previous, node in zip(nodes, nodes[1:], strict=False):
            node.parent, node.continued_choice = previous, int(previous.turn.chosen)
            previous.children.append(node)
        return nodes
    # conversation key (messages + one answer) → the latest node and choice ending with it
    ends: dict[str, tuple[Node, int]] = {}
    for node in nodes:
        messages = node.turn.messages or []
        keys = _prefix_keys(messages)
        for k in range(len(keys) - 1, -1, -1):  # the longest conversation first
            found = ends.get(keys[k])
            if found is not None:
                node.parent, node.continued_choice = found
                node.parent.children.append(node)
                break
        base = keys[-1] if keys else ""
        choices = (node.turn.response or {}).get("choices") or []
        for index, choice in enumerate(choices):
            answer = choice.get("message") if isinstance(choice, dict) else None
            if isinstance(answer, dict):
                ends[_digest(base, normalize_message(answer))] = (node, index)
    return nodes


def _continues_previous(previous, turn) -> bool:
    """``turn`` reused the exact tokens of ``previous`` (the turn just before it) and its answer."""
    if not getattr(turn, "prefix_reused", False):
        return False
    seen = list(previous.input_ids) + list(previous.outputs[previous.chosen]["output_ids"])
    return list(turn.input_ids[: len(seen)]) == seen


def drop_retry_orphans(nodes: list[Node]) -> tuple[list[Node], list[Node]]:
    """``(kept, orphans)``: the attempts at one request that nobody continued, when another
    attempt was continued or is later (see the module's rules)."""
    attempts: dict[str, list[Node]] = {}
    for node in nodes:
        request = _digest(
            (_prefix_keys(node.turn.messages or []) or [""])[-1], node.turn.tools or None
        )
        attempts.setdefault(request, []).append(node)
    orphans: set[int] = set()
    for same in attempts.values():
        if len(same) < 2:
            continue
        continued = [n for n in same if n.children]
        keep = continued or [same[-1]]
        orphans.update(id(n) for n in same if n not in keep)
    return (
        [n for n in nodes if id(n) not in orphans],
        [n for n in nodes if id(n) in orphans],
    )


def branches(nodes: list[Node]) -> list[list[Node]]:
    """The nodes (orphans left out) grouped into branches, each in turn order, ordered by their
    first turn."""
    out: list[list[Node]] = []
    tip: dict[int, int] = {}  # id(node) → the branch it is the last node of
    for node in nodes:
        index = tip.pop(id(node.parent), None) if node.parent is not None else None
        if index is None:
            out.append([node])
            index = len(out) - 1
        else:
            out[index].append(node)
        tip[id(node)] = index
    return out
