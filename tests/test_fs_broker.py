"""The embedded default's broker (``workers.fs_broker``): a message is never seen before it
is whole. kombu's own file-system transport creates the file and then writes it, and a
worker that read it in between stopped with JSONDecodeError (found by an end-to-end test)."""

from __future__ import annotations

import os
from queue import Empty

import pytest
from kombu import Connection

from workers import fs_broker


@pytest.fixture
def channel(tmp_path):
    folder = tmp_path / "queue"
    folder.mkdir()
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder)}
    with Connection(
        "filesystem://localhost//",
        transport="workers.fs_broker:Transport",
        transport_options=options,
    ) as connection:
        yield connection.default_channel


def test_the_broker_settings_name_this_transport(settings):
    assert settings.CELERY_BROKER_TRANSPORT == "workers.fs_broker:Transport"


def test_a_message_being_written_is_not_there_until_it_is_whole(channel, monkeypatch):
    assert isinstance(channel, fs_broker.Channel)
    seen_while_writing = []
    replace = os.replace

    def watched_replace(src, dst):  # the moment before the message becomes visible
        try:
            seen_while_writing.append(channel._get("celery"))
        except Empty:
            pass
        replace(src, dst)

    monkeypatch.setattr(fs_broker.os, "replace", watched_replace)
    channel._put("celery", {"body": "x" * 10_000})
    assert seen_while_writing == []
    assert channel._get("celery") == {"body": "x" * 10_000}
    with pytest.raises(Empty):
        channel._get("celery")


def test_messages_of_other_queues_and_dotted_names_are_kept_apart(channel):
    channel._put("celery.pidbox", {"n": 1})
    channel._put("celery", {"n": 2})
    assert channel._get("celery") == {"n": 2}
    assert channel._get("celery.pidbox") == {"n": 1}
