"""The model's ops with written-out backwards, and which of them each platform's programs take.

  matmul            the weight products, kept in the compute dtype forward and backward
  layer_norm        LayerNorm with autodiff's backward, or one that reads each row once
  einsum_attention  attention as einsums, the probabilities kept or recomputed for the backward
  qkv_projections   q, k and v as three products, or with their cotangents stacked in the backward
  tied_loss         the tied head's cross-entropy a chunk of positions at a time
  log_sum_exp       the one-pass row statistic the last two share

The platforms' compilers fuse differently, so a step's fastest program differs between them: `LOWERINGS`
holds each platform's choices (each measured, bench/RESULTS.md), and `for_program` reads the row of the
program being traced. The choices change how a step is computed, never what: every row gives the same
losses and gradients to rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from andrea_jax import sharding
from andrea_jax.ops import einsum_attention, layer_norm, matmul, qkv_projections


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One platform's ops."""
    matmul: Callable  # `matmul.matmul` with the platform's options
    layer_norm: Callable  # (x, scale, bias, epsilon, dtype) -> the normalized x
    attention: Callable  # the einsum attention without dropout: (q, k, v, mask, dtype) -> out
    query_block: int | None  # the einsum attention's queries a block (`einsum_attention.in_query_blocks`)
    qkv_projections: Callable  # (x, kernel, bias, dtype, biased) -> (q, k, v)
    gathered_positions: bool  # the position embedding gathered for each row rather than broadcast over the batch
    loss_chunk_tokens: int | None  # tokens a chunk of `tied_loss`'s head; None: optax's loss over the whole logits
    merged_heads_out: bool  # the einsum path's heads not a power of two wide merged into [B, L, D] for the output
    # projection: a 2-D product rather than one over heads and their width


# XLA:CPU's fast bfloat16 products return float32, and fused the cotangent's producers into each product.
_CPU_MATMUL = functools.partial(matmul.matmul, host=True)
CPU = Lowering(
    matmul=_CPU_MATMUL,
    layer_norm=layer_norm.layer_norm,
    attention=einsum_attention.softmax_attention,  # a CPU step is bound by its FLOPs: no second q·kᵀ
    query_block=128,
    qkv_projections=functools.partial(qkv_projections.three_products, matmul=_CPU_MATMUL),
    gathered_positions=False,
    loss_chunk_tokens=None,
    merged_heads_out=False,
)
# TPUs: the matmul's and attention's backwards every platform takes, and two that move fewer bytes here (q, k
# and v's cotangents stacked, the head's loss in chunks). Attention is the splash kernel's (attention.py): its
# einsum form serves dropout and decoding only, all queries at once.
TPU = Lowering(
    matmul=matmul.matmul,
    layer_norm=layer_norm.layer_norm,
    attention=einsum_attention.softmax_attention,
    query_block=None,
    qkv_projections=qkv_projections.stacked,
    gathered_positions=False,
    loss_chunk_tokens=8192,
    merged_heads_out=False,
)
# GPUs: XLA's GPU fusions re-read rows that these ops read once. Larger query blocks than a CPU's: the
# recomputing backward sums the blocks' key gradients, and larger blocks sum fewer of them for a little
# more of the square. The position embedding gathered: as a broadcast, its gradient's reduction over the
# batch had XLA's GPU compiler lay the whole stream out batch-minor, transposed at every product. Heads
# merged for the output projection: XLA's GPU compiler fuses the einsum path's output, laid out [B, H, K, L],
# into the projection's Triton GEMM through a transpose over H and K, and finds no tiles for heads that are not
# a power of two wide (20, 48, 96, 160, 192 on an A100: "Couldn't find output tile sizes"); the same for the
# stacked q, k and v cotangents in the product into x's gradient.
GPU = dataclasses.replace(
    TPU,
    matmul=functools.partial(matmul.matmul, bias_in_product=True),
    layer_norm=layer_norm.fused_layer_norm,
    attention=einsum_attention.recomputing_attention,
    query_block=256,
    qkv_projections=functools.partial(qkv_projections.stacked, merge_odd_heads=True),
    gathered_positions=True,
    merged_heads_out=True,
)
LOWERINGS = {"cpu": CPU, "gpu": GPU, "tpu": TPU}
# A platform the table does not name takes the TPU's ops: the CPU's row answers XLA:CPU (float32 products, a
# barrier) and the GPU's XLA's GPU fusions; the TPU's has neither.
DEFAULT = TPU


def for_program() -> Lowering:
    """The ops of the program being traced (`sharding.program_platform`: its mesh's platform, else the default)."""
    return LOWERINGS.get(sharding.program_platform(), DEFAULT)
