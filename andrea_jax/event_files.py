"""TensorBoard event files: their records, and dropping the events past a step (for a resume).

An event file is a TFRecord stream: per record an 8-byte length, a 4-byte CRC of it, the serialized Event,
and a 4-byte CRC of that. Kept records are copied byte for byte, so their checksums stay valid; a record cut
short by a kill ends the stream (its length's checksum is checked, as TensorBoard's reader does).
"""

from __future__ import annotations

import importlib
import os
import struct
import sys
from typing import Iterator

from google.protobuf.message import DecodeError

from andrea_jax.runtime import atomic


def _from_tensorboardx(module: str):
    """A tensorboardX module, imported with torch hidden. tensorboardX imports torch wherever it is
    installed (seconds of every train.py and eval.py start) only to accept torch tensors, which this
    project never passes; torch stays importable afterwards."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError meanwhile
    try:
        return importlib.import_module(module)
    finally:
        if hide:
            del sys.modules["torch"]


event_pb2 = _from_tensorboardx("tensorboardX.proto.event_pb2")
masked_crc32c = _from_tensorboardx("tensorboardX.record_writer").masked_crc32c
SummaryWriter = _from_tensorboardx("tensorboardX").SummaryWriter

_HEADER = struct.Struct("<QI")  # the data's length, and the CRC of those 8 bytes
_FOOTER = 4  # the CRC of the data
_REWRITE_PREFIX = ".rewrite."


def records(content: bytes) -> Iterator[tuple[bytes, event_pb2.Event]]:
    """(the record's bytes as stored, its Event) for every whole record."""
    offset = 0
    while offset + _HEADER.size <= len(content):
        length, length_crc = _HEADER.unpack_from(content, offset)
        end = offset + _HEADER.size + length + _FOOTER
        if length_crc != masked_crc32c(content[offset:offset + 8]) or end > len(content):
            return  # not a record's start: the tail of a write cut short
        event = event_pb2.Event()
        try:
            event.ParseFromString(content[offset + _HEADER.size:end - _FOOTER])
        except DecodeError:
            return
        yield content[offset:end], event
        offset = end


def drop_after(directory: str, step: int) -> None:
    """Rewrites (atomically) each event file in `directory` that holds events past `step`."""
    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(_REWRITE_PREFIX):  # from a rewrite that was killed
            os.remove(path)
        if "tfevents" not in name or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            content = f.read()
        kept = [raw for raw, event in records(content) if event.step <= step]
        if sum(len(raw) for raw in kept) < len(content):  # events past the step, or a record cut short
            # The default temporary name would contain "tfevents": TensorBoard reads every such
            # file, a half-written one too.
            atomic.write(path, b"".join(kept), temporary_name=f"{_REWRITE_PREFIX}{os.getpid()}")
