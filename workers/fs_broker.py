"""kombu's file-system transport (the embedded default's broker), with whole messages only.

kombu's own ``_put`` creates the message file and then writes it, and its ``_get`` reads
whatever file it finds without a lock: a worker that looks in between reads an empty or
half-written message, fails to parse it, and Celery stops with "Unrecoverable error:
JSONDecodeError" (seen on a loaded two-core machine, seconds after ``./steep up``). Here a
message is written under a name the consumer skips and then renamed into place, which on one
file system is atomic: a message is seen whole or not at all.

Selected by ``CELERY_BROKER_TRANSPORT = "workers.fs_broker:Transport"`` (webapp.settings);
the broker URL stays ``filesystem://``.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # A leading dot: the consumer takes only names of the form "<stamp>.<queue>.msg".
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb", buffering=0) as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
