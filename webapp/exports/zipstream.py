"""A folder as a zip archive, produced while it is sent: no temporary file, bounded memory."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

CHUNK_BYTES = 1024 * 1024


class ChunkSink:
    """A write-only, unseekable file whose bytes are handed on chunk by chunk (``take``): what
    zipfile writes an archive into (it then writes data descriptors after each member instead
    of seeking back to its header), and what pyarrow writes a Parquet file into."""

    closed = False

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.position = 0

    def write(self, data) -> int:
        self.buffer += data
        self.position += len(data)
        return len(data)

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def take(self) -> bytes:
        data = bytes(self.buffer)
        self.buffer.clear()
        return data


def folder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def zip_folder(folder: Path, root: str) -> Iterator[bytes]:
    """The files under ``folder`` as a zip whose entries sit under ``root/``, stored (model
    weights do not compress), at most ``CHUNK_BYTES`` read at a time."""
    sink = ChunkSink()
    with zipfile.ZipFile(sink, mode="w", compression=zipfile.ZIP_STORED) as archive:  # type: ignore[arg-type]
        for path in folder_files(folder):
            info = zipfile.ZipInfo.from_file(path, f"{root}/{path.relative_to(folder).as_posix()}")
            with open(path, "rb") as source, archive.open(info, "w") as target:
                while chunk := source.read(CHUNK_BYTES):
                    target.write(chunk)
                    yield sink.take()
            yield sink.take()
    yield sink.take()
