"""Receiving a multipart upload as a stream: the ``file`` part goes straight to disk.

The request body is parsed chunk by chunk with python-multipart's streaming parser, so an upload
never sits in memory whole, and an upload over the size limit is stopped as soon as it passes it.
A body that ends before the multipart's closing boundary (cut short, whatever its Content-Length
or chunking said) is refused: what arrived is not known to be the whole file. A UTF-8 byte-order
mark at the start of the file is dropped (editors on Windows add one; JSON forbids it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import nullcontext
from pathlib import Path
from typing import BinaryIO

import attrs
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from batchgen.core.errors import InvalidRequest, PayloadTooLarge

#: The largest plain form field (such as ``purpose``) accepted.
MAX_FIELD_BYTES = 1024
UTF8_BOM = b"\xef\xbb\xbf"


@attrs.define
class ReceivedUpload:
    fields: dict[str, str]
    filename: str | None
    size: int


class _PartCollector:
    """python-multipart callbacks that route the file part to disk and keep small fields."""

    def __init__(
        self, destination: BinaryIO, max_file_bytes: int, file_field: str = "file", strip_bom: bool = True
    ) -> None:
        self._destination = destination
        self._file_field = file_field
        self._strip_bom = strip_bom
        self._max_file_bytes = max_file_bytes
        self._header_field = bytearray()
        self._header_value = bytearray()
        self._headers: dict[str, bytes] = {}
        self._name: str | None = None
        self._value = bytearray()
        self._is_file = False
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_seen = False
        self.complete = False  # the closing boundary arrived
        self.size = 0
        self._file_head: bytearray | None = None  # the file's first bytes, until a BOM is ruled out

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda data, start, end: self._header_field.extend(data[start:end]),
            "on_header_value": lambda data, start, end: self._header_value.extend(data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self._headers = {}
        self._name = None
        self._value = bytearray()
        self._is_file = False

    def _header_end(self) -> None:
        self._headers[bytes(self._header_field).decode("latin-1").lower()] = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get("content-disposition", b""))
        name = options.get(b"name")
        self._name = name.decode("utf-8", "replace") if name is not None else None
        if self._name == self._file_field:
            if self.file_seen:
                raise InvalidRequest(
                    f"only one {self._file_field!r} part may be sent", param=self._file_field
                )
            self.file_seen = True
            self._is_file = True
            self._file_head = bytearray() if self._strip_bom else None
            raw_filename = options.get(b"filename")
            self.filename = raw_filename.decode("utf-8", "replace") if raw_filename else None

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            chunk = data[start:end]
            if self._file_head is not None:  # hold the first bytes back until a BOM is ruled out
                self._file_head.extend(chunk)
                if len(self._file_head) < len(UTF8_BOM):
                    return
                chunk = self._take_file_head()
            self._write_file(chunk)
        else:
            self._value.extend(data[start:end])
            if len(self._value) > MAX_FIELD_BYTES:
                raise InvalidRequest(f"form field {self._name!r} is too long", param=self._name)

    def _take_file_head(self) -> bytes:
        head = bytes(self._file_head or b"")
        self._file_head = None
        return head.removeprefix(UTF8_BOM)

    def _write_file(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self._max_file_bytes:
            raise PayloadTooLarge(f"The upload is larger than the limit of {self._max_file_bytes} bytes.")
        self._destination.write(chunk)

    def _part_end(self) -> None:
        if self._is_file and self._file_head is not None:  # a file shorter than a BOM
            self._write_file(self._take_file_head())
        if not self._is_file and self._name is not None:
            self.fields[self._name] = self._value.decode("utf-8", "replace")

    def _end(self) -> None:
        self.complete = True


async def receive_upload(
    content_type: str,
    body: AsyncIterator[bytes],
    destination: Path | BinaryIO,
    max_file_bytes: int,
    *,
    file_field: str = "file",
    strip_bom: bool = True,
) -> ReceivedUpload:
    """Stream a multipart body into ``destination`` (a file made anew, or a stream open for
    writing, left open); return the form fields and file details.

    The file is the part named ``file_field``; a UTF-8 byte order mark at its start is left out
    unless ``strip_bom`` is false (a part of a chunked upload keeps its exact bytes)."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise InvalidRequest(
            f"uploads must be multipart/form-data with a {file_field!r} part"
            + (" and a 'purpose' field" if file_field == "file" else ""),
            param="file",
        )
    with open(destination, "wb") if isinstance(destination, Path) else nullcontext(destination) as stream:
        collector = _PartCollector(stream, max_file_bytes, file_field, strip_bom)
        parser = MultipartParser(boundary, collector.callbacks())  # type: ignore[arg-type]
        try:
            async for chunk in body:
                parser.write(chunk)
            parser.finalize()
        except MultipartParseError as exc:
            raise InvalidRequest(f"the multipart body is malformed: {exc}", param="file") from exc
    if not collector.complete:
        raise InvalidRequest(
            "the upload was cut short: the body ended before the multipart closing boundary, "
            "so the file may be incomplete; nothing was stored",
            param="file",
        )
    if not collector.file_seen:
        raise InvalidRequest(f"the upload has no {file_field!r} part", param=file_field)
    return ReceivedUpload(collector.fields, collector.filename, collector.size)
