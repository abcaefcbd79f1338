"""A compiled program's HLO text without where it was traced from: what two compiles are compared by.

XLA's text holds source tables (FileNames, FunctionNames, FileLocations, StackFrames) between the
module's header and its computations, and each instruction's metadata={op_name=... stack_frame_id=...}
(source_file= and source_line= in older versions). Two traces of one program made from different
lines differ only there; everything else, the header and every computation, is kept.
"""

from __future__ import annotations

import re

_SOURCE_TABLE = re.compile(r"^(?:FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*\n*", re.M)
# Quoted op names may hold braces: a string is skipped whole.
_METADATA = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def without_source_info(hlo_text: str) -> str:
    """The whole program, without its source tables and instructions' metadata."""
    return _METADATA.sub("", _SOURCE_TABLE.sub("", hlo_text))
