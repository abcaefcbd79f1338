"""The memory traffic of a compiled step, counted from its optimized HLO, and where in the model it goes.

Every top-level instruction reads its operands from device memory and writes its output there
(a fusion's inner values stay on chip), so a step's traffic is the sum of their bytes; a `while`
body counts as many times as its known trip count. Values in another memory space (a TPU's VMEM
or SMEM, `S(n)` in the layout) are on chip and not counted; an asynchronous copy counts its
read at the start and its write at the end. Tile padding is not counted. Each instruction is
charged to a part of the model by the source path XLA keeps in its metadata (Flax module names).
"""

from __future__ import annotations

import collections
import dataclasses
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
               "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16}
# An array shape with its optional layout: bf16[32,1024,768]{2,1,0:T(8,128)(2,1)S(1)}.
ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (.*)$")
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
        "replica-id", "opt-barrier"}
LAYOUT_OPS = {"copy", "transpose"}
PARTS = ("attention", "MLP", "norms", "embeddings, logits and loss", "optimizer", "layout copies", "other")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    output: str  # the output shape's text
    operands: tuple[str, ...]
    attributes: str

    def op_name(self) -> str:
        match = re.search(r'op_name="([^"]*)"', self.attributes)
        return match.group(1) if match else ""


def array_bytes(shape_text: str, on_chip_too: bool = False) -> float:
    """Bytes of every array in a shape (a tuple's elements summed), those in device memory only
    unless `on_chip_too`; f8 types count one byte."""
    total = 0.0
    for dtype, dims, layout in ARRAY.findall(shape_text):
        if not on_chip_too and layout and re.search(r"S\(([1-9]\d*)\)", layout):
            continue
        size = 1
        for dim in filter(None, dims.split(",")):
            size *= int(dim)
        total += size * DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)
    return total


def _arrays(shape_text: str) -> list[str]:
    """The array shapes of a shape's text, in order."""
    return [match.group(0) for match in ARRAY.finditer(shape_text)]


def _split_shape(rest: str) -> tuple[str, str]:
    """'(a, b) op(...)' or 'f32[2]{0} op(...)' -> (shape, the rest)."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[:i + 1], rest[i + 1:].lstrip()
    raise ValueError(f"unbalanced shape in HLO: {rest[:80]}")


def _parse_instruction(line: str) -> Instruction | None:
    match = INSTRUCTION.match(line)
    if not match:
        return None
    name, rest = match.groups()
    shape, rest = _split_shape(rest)
    opcode, _, rest = rest.partition("(")
    depth, end = 1, len(rest)
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = i
            break
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[:end]))
    return Instruction(name, opcode.strip(), shape, operands, rest[end + 1:])


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """(instructions of each computation by name, the entry computation's name)."""
    computations, entry, lines = {}, None, []
    for line in hlo_text.splitlines():  # a kernel's metadata may span lines: join them to their instruction
        if line.startswith("  ") or not lines or lines[-1] is None or re.match(r"(ENTRY )?%\S+ \(|}$", line):
            lines.append(None if line == "}" else line)
        else:
            lines[-1] += line
    current = None
    for line in lines:
        header = None if line is None else re.match(r"(ENTRY )?%(\S+) \(", line)
        if line is None:
            current = None
        elif header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif current is not None:
            instruction = _parse_instruction(line)
            if instruction is not None:
                current.append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def part_of(instruction: Instruction, computations: dict[str, list[Instruction]]) -> str:
    """The part of the model an instruction belongs to, by its opcode and source path."""
    if instruction.opcode in LAYOUT_OPS or _fused_root(instruction, computations) in LAYOUT_OPS:
        return "layout copies"
    path = instruction.op_name()
    if "/attn/" in path:
        return "attention"
    if "/mlp/" in path:
        return "MLP"
    if "/ln_" in path:
        return "norms"
    if "jvp(" in path and "/block_" not in path and "/blocks/" not in path:
        return "embeddings, logits and loss"  # the model's forward and backward outside its blocks
    if path and "jvp(" not in path and "transpose(" not in path:
        return "optimizer"  # the update: clipping, AdamW, the step counter
    return "other"


def _parts(body: list[Instruction], computations: dict[str, list[Instruction]]) -> dict[str, str]:
    """The part of each instruction of a computation. One without a source path (a TPU's prefetch
    into on-chip memory, say) takes the part of the instruction that uses its result."""
    parts = {i.name: part_of(i, computations) for i in body}
    users = collections.defaultdict(list)
    for instruction in body:
        for operand in instruction.operands:
            users[operand].append(instruction.name)
    for instruction in reversed(body):  # users come later, so their parts are settled first
        if parts[instruction.name] == "other" and not instruction.op_name():
            found = [parts[u] for u in users[instruction.name] if parts[u] != "other"]
            if found:
                parts[instruction.name] = found[0]
    return parts


def _fused_root(instruction: Instruction, computations: dict[str, list[Instruction]]) -> str | None:
    """The opcode a fusion ends in, looking through bitcasts (a fused transpose is a layout copy)."""
    if instruction.opcode != "fusion":
        return None
    called = re.search(r"calls=%([\w.\-]+)", instruction.attributes)
    body = computations.get(called.group(1), []) if called else []
    by_name = {i.name: i for i in body}
    root = body[-1] if body else None
    while root is not None and root.opcode == "bitcast" and root.operands:
        root = by_name.get(root.operands[0])
    return root.opcode if root else None


def _trip_count(instruction: Instruction) -> int:
    match = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attributes)
    return int(match.group(1)) if match else 1


def count(hlo_text: str) -> dict[str, float]:
    """Device-memory bytes a run of the program moves, by part of the model (`PARTS`)."""
    computations, entry = parse(hlo_text)
    by_part = collections.defaultdict(float)

    def walk(name: str, times: int) -> None:
        body = computations[name]
        shapes = {i.name: i.output for i in body}
        parts = _parts(body, computations)
        for instruction in body:
            opcode = instruction.opcode
            if opcode in ("while", "call"):  # a loop's body counts once a trip; a call's once
                key, trips = ("body", _trip_count(instruction)) if opcode == "while" else ("to_apply", 1)
                for computation in re.findall(rf"{key}=%([\w.\-]+)", instruction.attributes):
                    walk(computation, times * trips)
                continue
            if opcode in FREE:
                continue
            read = sum(array_bytes(shapes.get(operand, "")) for operand in instruction.operands)
            written = array_bytes(instruction.output)
            # A slice reads only what it writes; an asynchronous one writes the slice into the
            # output's last arrays (on chip, on a TPU), after the source's alias.
            if opcode in ("slice", "dynamic-slice"):
                read = written
            elif opcode == "slice-start":
                read = sum(array_bytes(shape, on_chip_too=True) for shape in _arrays(instruction.output)[-2:])
            if opcode.endswith("-start"):
                written = 0.0  # the output aliases the source; the write is the -done's
            elif opcode.endswith("-done"):
                read = 0.0
            by_part[parts[instruction.name]] += times * (read + written)

    walk(entry, 1)
    return {part: by_part[part] for part in PARTS if by_part[part]}
