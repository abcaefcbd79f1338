"""A step's time as the chip runs it: one kernel after another, each at its kind's rate.

A GPU runs the top-level kernels of the optimized program one at a time, and a TPU one fusion at a time
(matrix and vector work overlap only inside a fusion). So a step takes about the sum over its kernels of
max(FLOPs at the rate of the kernel's kind, bytes at the memory's achievable bandwidth) plus the gap a
launch leaves between two kernels; a `while` body counts as many times as it runs. The rates are the
target's (`targets.KernelRates`), each with its source.

A product's rate depends on its shape: its output is cut into tiles, each tile worked by one of the
chip's cores, and the K dimension split until there are enough pieces to go round (split-K, as cuBLAS
and XLA's Triton products do); the last wave of pieces leaves cores idle, so a product whose pieces fill
few waves (a 768 × 768 Newton–Schulz product on 132 cores) runs at a fraction of a large product's rate.
"""

from __future__ import annotations

import dataclasses
import math
import re

from andrea_jax.compile import hbm_traffic

KINDS = ("matrix products", "attention", "other fusions", "copies")
TILE = 128  # the side of an output tile a core works on (cuBLAS's and Triton's common 128 × 128)
MIN_SPLIT_K = 512  # the shortest piece of K a split leaves a core
DTYPE_RATES = {"bf16": "16-bit", "f16": "16-bit", "f32": "float32"}  # a product's inputs -> its rate
# An attention kernel's backward by its name or target: cuDNN's fmha...Backward, splash's splash_mha_dkv_... (which
# computes dq too, as attention.py runs it) and splash_mha_dq_..., the older Pallas flash_attention_bwd_....
BACKWARD = re.compile(r"backward|bwd|grad|(?<![a-z])(?:dkv|dq)(?![a-z])", re.I)


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    kind: str
    flops: float  # 0 for memory-bound kernels
    bytes: float
    seconds: float  # one run, without its launch
    times: int  # runs a step (a loop body's trips)
    op_name: str


@dataclasses.dataclass(frozen=True)
class Estimate:
    kernels: list[Kernel]
    seconds_by_kind: dict[str, float]  # a step, `KINDS` and "launches"

    @property
    def seconds(self) -> float:
        return sum(self.seconds_by_kind.values())

    def top(self, count: int) -> list[tuple[str, str, float, int]]:
        """The `count` costliest kernels a step, identical fused computations together (a GPU runs them as
        one kernel under the first one's name, as a trace shows them): (name, kind, seconds, runs)."""
        groups = {}
        for kernel in self.kernels:
            key = (re.sub(r"[._]\d+$", "", kernel.name), kernel.kind, kernel.op_name.split("/")[-1],
                   round(kernel.bytes), round(kernel.flops))
            group = groups.setdefault(key, [kernel.name, kernel.kind, 0.0, 0])
            group[2] += kernel.seconds * kernel.times
            group[3] += kernel.times
        return sorted((tuple(group) for group in groups.values()), key=lambda group: -group[2])[:count]


class MissingRate(ValueError):
    """The target has no rate for a kind of kernel the program runs."""


def _custom_target(instruction: hbm_traffic.Instruction) -> str:
    found = re.search(r'custom_call_target="([^"]+)"', instruction.attributes)
    return found.group(1) if found else ""


def kind_of(instruction: hbm_traffic.Instruction, computations: dict[str, list[hbm_traffic.Instruction]],
            fused_dot: bool) -> str:
    """A kernel's kind as a profiler's trace names it (bench/trace_step.py sums by the same kinds); its layout
    copies are the bytes table's (`hbm_traffic.is_layout_copy`)."""
    target = _custom_target(instruction)
    if re.search(r"cudnn\$fmha|fmha|flash|splash|attention", target + " " + instruction.name, re.I):
        return "attention"
    if fused_dot or instruction.opcode in ("dot", "convolution") or re.search(r"cublas|gemm|matmul", target, re.I):
        return "matrix products"
    if hbm_traffic.is_layout_copy(instruction, computations):
        return "copies"
    return "other fusions"


def _dims(shape_text: str) -> tuple[str, list[int]]:
    dtype, dims, _ = hbm_traffic.ARRAY.search(shape_text).groups()
    return dtype, [int(d) for d in filter(None, dims.split(","))]


def product_shape(dot: hbm_traffic.Instruction, shapes: dict[str, str]) -> tuple[str, int, int, int, int]:
    """(input dtype, batch, M, N, K) of a dot or a GEMM custom call, from its operands and dimension numbers."""
    lhs_dtype, lhs = _dims(shapes[dot.operands[0]])
    _, rhs = _dims(shapes[dot.operands[1]])

    def listed(field: str) -> list[int]:  # HLO's `lhs_contracting_dims={1}`, a GEMM call's JSON `..._dimensions":["1"]`
        found = re.search(rf'{field}_dim(?:s|ensions)[=":\[{{]+([\d,"\s]*)', dot.attributes)
        return [int(d) for d in re.findall(r"\d+", found.group(1))] if found else []

    lhs_contracting, rhs_contracting = listed("lhs_contracting"), listed("rhs_contracting")
    lhs_batch, rhs_batch = listed("lhs_batch"), listed("rhs_batch")
    k = math.prod(lhs[d] for d in lhs_contracting)
    batch = math.prod(lhs[d] for d in lhs_batch)
    m = math.prod(size for d, size in enumerate(lhs) if d not in lhs_contracting + lhs_batch)
    n = math.prod(size for d, size in enumerate(rhs) if d not in rhs_contracting + rhs_batch)
    return lhs_dtype, batch, m, n, k


def wave_efficiency(batch: int, m: int, n: int, k: int, cores: int) -> float:
    """The share of the cores' time a product keeps busy: its tiles (split along K while there are fewer
    pieces than cores and K allows) run in waves of `cores`, the last wave partly filled."""
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    split = 1
    while tiles * split < cores and k // (2 * split) >= MIN_SPLIT_K:
        split *= 2
    pieces = tiles * split
    filled = (m * n) / (math.ceil(m / TILE) * math.ceil(n / TILE) * TILE * TILE)  # ragged edge tiles
    return filled * pieces / (math.ceil(pieces / cores) * cores)


def attention_flops(call: hbm_traffic.Instruction, shapes: dict[str, str], shares: tuple[float, float]) -> float:
    """FLOPs of a fused attention call: q·kᵀ and p·v forward (4·B·H·Lq·Lk·D), 2.5 times that backward (the
    scores again, then dV, dP, dQ, dK), each at the share of the L × L square the kernel computes under the
    causal mask (`shares`: forward, backward). q and k are its first two 4-D operands, [B, L, H, D] or
    [B, H, L, D] with D last; the longer of the middle two is L."""
    q, key = [_dims(shapes[o])[1] for o in call.operands if len(_dims(shapes.get(o, "pred[]"))[1]) == 4][:2]
    batch, width = q[0], q[-1]
    heads, q_len = sorted(q[1:3])
    forward = 4 * batch * heads * q_len * max(key[1:3]) * width
    backward = BACKWARD.search(call.name + " " + _custom_target(call)) is not None
    return forward * 2.5 * shares[1] if backward else forward * shares[0]


def convolution_flops(conv: hbm_traffic.Instruction, shapes: dict[str, str]) -> float:
    """FLOPs of a convolution (how XLA's TPU compiler writes a product): 2 × the output's batch and feature
    elements × the input features a group × the window's taps that land inside the input, summed over the
    output positions of each spatial dimension (the TPU's padded windows over a size-1 input take one tap)."""
    lhs_labels, _, out_labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", conv.attributes).groups()
    _, lhs = _dims(shapes[conv.operands[0]])
    _, out = _dims(conv.output)
    window = re.search(r"window=\{([^}]*)\}", conv.attributes)
    sizes = [int(n) for n in re.search(r"size=([\dx]+)", window.group(1)).group(1).split("x")] if window else []
    pads = re.search(r"pad=([\d_x]+)", window.group(1)) if window else None
    lows = [int(p.split("_")[0]) for p in pads.group(1).split("x")] if pads else [0] * len(sizes)
    groups = re.search(r"feature_group_count=(\d+)", conv.attributes)
    taps = 1
    for d, size in enumerate(sizes):
        length, positions = lhs[lhs_labels.index(str(d))], out[out_labels.index(str(d))]
        taps *= sum(max(0, min(positions, length + lows[d] - t) - max(0, lows[d] - t)) for t in range(size))
    spatial = "".join(str(d) for d in range(len(sizes)))
    rest = math.prod(n for label, n in zip(out_labels, out) if label not in spatial)
    return 2.0 * rest * lhs[lhs_labels.index("f")] / (int(groups.group(1)) if groups else 1) * taps


def estimate(hlo_text: str, rates, attention_shares: tuple[float, float] = (0.5, 0.5),
             attention_fill: float = 1.0) -> Estimate:
    """The serial time of a run of `hlo_text` at `rates` (`targets.KernelRates`); attention's kernels compute
    `attention_shares` of the causal square (forward, backward) at `attention_fill` of their rate (a TPU's
    matrix units that heads narrower than them fill partly).

    Raises MissingRate when the program runs a kind of kernel the rates have no figure for."""
    computations, entry = hbm_traffic.parse(hlo_text)
    kernels: list[Kernel] = []
    for body, times in hbm_traffic.bodies(computations, entry):
        shapes = {i.name: i.output for i in body}
        for instruction in body:
            # An asynchronous copy or slice (a TPU's prefetch into on-chip memory) runs beside the kernels.
            if instruction.opcode in hbm_traffic.FREE or instruction.opcode.endswith(("-start", "-done")):
                continue
            kernels.append(_kernel(instruction, shapes, computations, rates, times, attention_shares,
                                   attention_fill))
    by_kind = {kind: sum(k.seconds * k.times for k in kernels if k.kind == kind) for kind in KINDS}
    by_kind["launches"] = rates.launch_seconds * sum(k.times for k in kernels)
    return Estimate(kernels, by_kind)


def _kernel(instruction, shapes, computations, rates, times, attention_shares, attention_fill) -> Kernel:
    fused = computations.get((hbm_traffic.called(instruction, "calls") or [""])[0], [])
    dots = [i for i in fused if i.opcode in ("dot", "convolution")]
    operand_shapes = {i.name: i.output for i in fused}  # the dots' operands are the fused computation's values
    kind = kind_of(instruction, computations, bool(dots))
    if kind == "matrix products" and not dots:  # a dot, or a cuBLAS call with the dot's dimension numbers
        dots, operand_shapes = [instruction], shapes
    flops, compute_seconds = 0.0, 0.0
    if kind == "attention":
        if not rates.attention:
            raise MissingRate("attention")
        flops = attention_flops(instruction, shapes, attention_shares)
        compute_seconds = flops / (rates.attention * attention_fill)
    elif kind == "matrix products":
        for dot in dots:
            dtype = DTYPE_RATES.get(_dims(operand_shapes[dot.operands[0]])[0])
            if not rates.products.get(dtype):
                raise MissingRate(f"{dtype} products")
            if dot.opcode == "convolution":  # a TPU's: its matrix units have no waves to fill
                dot_flops, efficiency = convolution_flops(dot, operand_shapes), 1.0
            else:
                _, batch, m, n, k = product_shape(dot, operand_shapes)
                dot_flops, efficiency = 2.0 * batch * m * n * k, wave_efficiency(batch, m, n, k, rates.cores)
            flops += dot_flops
            compute_seconds += dot_flops / (rates.products[dtype] * efficiency)
    moved = hbm_traffic.moved_bytes(instruction, shapes)
    seconds = max(compute_seconds, moved / rates.memory_bytes_per_second)
    return Kernel(instruction.name, kind, flops, moved, seconds, times, instruction.op_name)
