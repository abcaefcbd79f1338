"""The memory traffic of a compiled step, counted from its optimized HLO, and where in the model it goes.

Every top-level instruction reads its operands from device memory and writes its output there
(a fusion's inner values stay on chip), so a step's traffic is the sum of their bytes; a `while`
body counts as many times as it runs (XLA's known trip count, or its condition's bound). Values
in another memory space (a TPU's VMEM or SMEM, `S(n)` in the layout) are on chip and not counted;
an asynchronous copy counts its read at the start and its write at the end. Tile padding is not counted. Each instruction is
charged to a part of the model by the source path XLA keeps in its metadata (Flax module names).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Iterator

# An array shape with its optional layout: bf16[32,1024,768]{2,1,0:T(8,128)(2,1)S(1)}.
ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
# `%name = shape opcode(operands), attributes`; a tuple's shape is in parentheses, and no " word(" is inside it.
INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$")
# Instructions that move nothing themselves; a while, call or conditional's traffic is its called computations'.
FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
        "replica-id", "opt-barrier", "while", "call", "conditional"}
LAYOUT_OPS = {"copy", "transpose"}
PARTS = ("attention", "MLP", "norms", "embeddings, logits and loss", "optimizer", "layout copies", "other")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    output: str  # the output shape's text
    operands: tuple[str, ...]
    attributes: str
    op_name: str  # the source path in its metadata, "" where it has none
    literal: str = ""  # a constant's value, as written


def array_bytes(shape_text: str, on_chip_too: bool = False) -> float:
    """Bytes of every array in a shape (a tuple's elements summed), those in device memory only unless `on_chip_too`."""
    total = 0.0
    for dtype, dims, layout in ARRAY.findall(shape_text):
        if on_chip_too or not re.search(r"S\(([1-9]\d*)\)", layout):
            # An element's bits are in its type's name (bf16, s4, f8e4m3fn); a pred takes a byte, a token none.
            bits = 8 if dtype == "pred" else int(re.match(r"[a-z]*(\d*)", dtype).group(1) or 0)
            total += math.prod(int(dim) for dim in filter(None, dims.split(","))) * bits / 8
    return total


def _parse_instruction(line: str) -> Instruction | None:
    match = INSTRUCTION.match(line)
    if not match:
        return None
    name, shape, opcode, rest = match.groups()
    depth, end = 1, len(rest)  # the operands end at the parenthesis that closes theirs
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = i
            break
    op_name = re.search(r'op_name="([^"]*)"', rest[end + 1:])
    return Instruction(name, opcode, shape, tuple(re.findall(r"%([\w.\-]+)", rest[:end])), rest[end + 1:],
                       op_name.group(1) if op_name else "", rest[:end] if opcode == "constant" else "")


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """(instructions of each computation by name, the entry computation's name)."""
    computations, entry = {}, None
    for match in re.finditer(r"^(ENTRY )?%(\S+) \(.*?\n(.*?)^}$", hlo_text, re.M | re.S):
        body = re.sub(r"\n(?!  )", "", match.group(3))  # a kernel's metadata may span lines: join them
        computations[match.group(2)] = [i for i in map(_parse_instruction, body.splitlines()) if i is not None]
        entry = match.group(2) if match.group(1) else entry
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def part_of(instruction: Instruction, computations: dict[str, list[Instruction]]) -> str:
    """The part of the model an instruction belongs to, by its opcode and source path."""
    if is_layout_copy(instruction, computations):
        return "layout copies"
    path = instruction.op_name
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


def called(instruction: Instruction, attribute: str) -> list[str]:
    """The computations `instruction` names by the attributes `attribute` (a pattern) matches: `calls=%f`,
    `branch_computations={%a, %b}`."""
    named = re.findall(rf"\b(?:{attribute})=(%[\w.\-]+|\{{[^}}]*\}})", instruction.attributes)
    return re.findall(r"%([\w.\-]+)", " ".join(named))


def _called_root(instruction: Instruction, attribute: str,
                 computations: dict[str, list[Instruction]]) -> tuple[Instruction | None, dict[str, Instruction]]:
    """The root of the computation `instruction` names by `attribute` (calls=, condition=), and that
    computation's instructions by name; (None, {}) where it names none."""
    body = computations.get((called(instruction, attribute) or [""])[0], [])
    return (body[-1] if body else None), {i.name: i for i in body}


def is_layout_copy(instruction: Instruction, computations: dict[str, list[Instruction]]) -> bool:
    """Whether an instruction only lays data out anew: a copy, a transpose, or a fusion that ends in one,
    looking through bitcasts (a TPU's fused transpose is named `fusion.N`, so its contents, not its name,
    tell). The bytes table and the kernel-time estimate both classify by this."""
    if instruction.opcode != "fusion":
        return instruction.opcode in LAYOUT_OPS
    root, by_name = _called_root(instruction, "calls", computations)
    while root is not None and root.opcode == "bitcast" and root.operands:
        root = by_name.get(root.operands[0])
    return root is not None and root.opcode in LAYOUT_OPS


def trip_count(loop: Instruction, computations: dict[str, list[Instruction]]) -> int:
    """A while loop's trips: XLA's known_trip_count (GPUs give it), else the N of a condition
    `counter < N` (a TPU's micro-batch loop: JAX's counters start at 0), else 1."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attributes)
    if known:
        return int(known.group(1))
    root, by_name = _called_root(loop, "condition", computations)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attributes or len(root.operands) != 2:
        return 1
    bound = by_name.get(root.operands[1])
    value = re.fullmatch(r"\s*(\d+)\s*", bound.literal) if bound is not None and bound.opcode == "constant" else None
    return int(value.group(1)) if value else 1


def bodies(computations: dict[str, list[Instruction]], entry: str) -> Iterator[tuple[list[Instruction], int]]:
    """Each computation a run of the program executes, with how many times: the entry once, a `while` body its
    trip count times its caller's, a `call`'s once its caller's, a `conditional`'s costliest branch once its
    caller's."""
    pending = [(entry, 1)]
    while pending:
        name, times = pending.pop()
        body = computations[name]
        yield body, times
        for instruction in body:
            if instruction.opcode in ("while", "call"):
                trips = trip_count(instruction, computations) if instruction.opcode == "while" else 1
                pending += [(computation, times * trips) for computation in called(instruction, "body|to_apply")]
            elif instruction.opcode == "conditional":
                # One branch runs, which one only the run knows (a float16 step applies its update or skips
                # it): the costliest in bytes counts, a step the run can take. The bytes table and the
                # estimate both walk this, so they count the same branch.
                branches = called(instruction, r"\w+_computations?")  # true/false_, or branch_computations
                pending.append((max(branches, key=lambda branch: _bytes_of(computations, branch)), times))


def _bytes_of(computations: dict[str, list[Instruction]], name: str) -> float:
    """Device-memory bytes one run of computation `name` moves, with what it calls."""
    return sum(times * moved_bytes(i, {j.name: j.output for j in body})
               for body, times in bodies(computations, name) for i in body if i.opcode not in FREE)


def moved_bytes(instruction: Instruction, shapes: dict[str, str]) -> float:
    """Device-memory bytes one run of a top-level instruction reads and writes."""
    opcode = instruction.opcode
    read = sum(array_bytes(shapes.get(operand, "")) for operand in instruction.operands)
    written = array_bytes(instruction.output)
    # A slice reads only what it writes; an asynchronous one writes the slice into the
    # output's last arrays (on chip, on a TPU), after the source's alias.
    if opcode in ("slice", "dynamic-slice"):
        read = written
    elif opcode == "slice-start":
        read = array_bytes(" ".join(m.group(0) for m in list(ARRAY.finditer(instruction.output))[-2:]), True)
    if opcode.endswith("-start"):
        written = 0.0  # the output aliases the source; the write is the -done's
    elif opcode.endswith("-done"):
        read = 0.0
    return read + written


def count(hlo_text: str) -> dict[str, float]:
    """Device-memory bytes a run of the program moves, by part of the model (`PARTS`)."""
    computations, entry = parse(hlo_text)
    by_part = collections.defaultdict(float)
    for body, times in bodies(computations, entry):
        shapes = {i.name: i.output for i in body}
        parts = {i.name: part_of(i, computations) for i in body}
        users = collections.defaultdict(list)
        for instruction in body:
            for operand in instruction.operands:
                users[operand].append(instruction.name)
        # One without a source path (a TPU's prefetch into on-chip memory, say) takes the part of the first
        # instruction that uses its result; users come later, so their parts are settled first.
        for instruction in reversed(body):
            if parts[instruction.name] == "other" and not instruction.op_name:
                parts[instruction.name] = next((parts[u] for u in users[instruction.name] if parts[u] != "other"),
                                               "other")
        for instruction in body:
            if instruction.opcode not in FREE:
                by_part[parts[instruction.name]] += times * moved_bytes(instruction, shapes)
    return {part: by_part[part] for part in PARTS if by_part[part]}
