"""The memory-traffic count of a compiled step, on a hand-written HLO module and on a compiled CPU step."""

import jax
import jax.numpy as jnp
import pytest

from andrea_jax.compile import hbm_traffic

# A loop of 12 trips whose body runs a fusion, with a fused transpose and an on-chip (S(1)) value.
MODULE = """HloModule step

%fused_gelu (p: bf16[4,8]) -> bf16[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %t = bf16[4,8]{1,0} tanh(%p)
}

%fused_transpose (p: bf16[4,8]) -> bf16[8,4] {
  %p = bf16[4,8]{1,0} parameter(0)
  %t = bf16[8,4]{0,1} transpose(%p), dimensions={1,0}
  ROOT %b = bf16[8,4]{1,0} bitcast(%t)
}

%body (state: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %state = (s32[], bf16[4,8]{1,0}) parameter(0)
  %x = bf16[4,8]{1,0} get-tuple-element(%state), index=1
  %gelu = bf16[4,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_gelu, metadata={op_name="jit(step)/jvp(Transformer)/block_0/mlp/tanh"}
  %i = s32[] get-tuple-element(%state), index=0
  ROOT %out = (s32[], bf16[4,8]{1,0}) tuple(%i, %gelu)
}

%cond (state: (s32[], bf16[4,8])) -> pred[] {
  %state = (s32[], bf16[4,8]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: bf16[4,8], w: f32[16]) -> bf16[8,4] {
  %x = bf16[4,8]{1,0} parameter(0)
  %w = f32[16]{0} parameter(1)
  %vmem = f32[16]{0:S(1)} negate(%w)
  %update = f32[16]{0} add(%vmem, %w), metadata={op_name="jit(step)/adamw/add"}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,8]{1,0}) tuple(%zero, %x)
  %loop = (s32[], bf16[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %y = bf16[4,8]{1,0} get-tuple-element(%loop), index=1
  %part = bf16[2,8]{1,0} slice(%y), slice={[0:2], [0:8]}, metadata={op_name="jit(step)/jvp(Transformer)/block_0/attn/slice"}
  ROOT %yt = bf16[8,4]{1,0} fusion(%y), kind=kLoop, calls=%fused_transpose
}
"""


def test_each_instruction_is_its_operands_and_output_loops_times_their_trips_on_chip_values_free():
    parts = hbm_traffic.count(MODULE)
    block = 4 * 8 * 2  # one bf16[4,8]
    assert parts["MLP"] == 12 * 2 * block  # read and written on each of 12 trips
    assert parts["layout copies"] == 2 * block  # the fused transpose
    assert parts["attention"] == 2 * (2 * 8 * 2)  # a slice reads only what it writes
    # The negation into on-chip memory reads 64 bytes and writes none to HBM; the add reads the HBM
    # operand only and writes 64; the negation has no source path and takes its user's part.
    assert parts["optimizer"] == 64 + 64 + 64
    assert set(parts) == {"MLP", "layout copies", "attention", "optimizer"}


def test_a_loop_without_a_known_trip_count_runs_to_its_condition_bound():
    """How a TPU's micro-batch loop reads: no known_trip_count, a condition `counter < 5`."""
    counted = MODULE.replace(', backend_config={"known_trip_count":{"n":"12"}}', "").replace(
        "  ROOT %p = pred[] constant(true)",
        "  %i = s32[] get-tuple-element(%state), index=0\n  %n = s32[] constant(5)\n"
        "  ROOT %lt = pred[] compare(%i, %n), direction=LT")
    assert hbm_traffic.count(counted)["MLP"] == 5 * 2 * 4 * 8 * 2
    unknown = MODULE.replace(', backend_config={"known_trip_count":{"n":"12"}}', "")
    assert hbm_traffic.count(unknown)["MLP"] == 2 * 4 * 8 * 2  # no bound to read: counted once


# A float16 step's skip-or-apply: the update branch runs two fusions, the skip branch one negation.
CONDITIONAL = """HloModule step

%fused_gelu (p: bf16[4,8]) -> bf16[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %t = bf16[4,8]{1,0} tanh(%p)
}

%apply (p: bf16[4,8]) -> bf16[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  %update = bf16[4,8]{1,0} fusion(%p), kind=kLoop, calls=%fused_gelu, metadata={op_name="jit(step)/adamw/mul"}
  ROOT %update2 = bf16[4,8]{1,0} fusion(%update), kind=kLoop, calls=%fused_gelu, metadata={op_name="jit(step)/adamw/add"}
}

%skip (p: bf16[4,8]) -> bf16[4,8] {
  %p = bf16[4,8]{1,0} parameter(0)
  ROOT %neg = bf16[4,8]{1,0} negate(%p), metadata={op_name="jit(step)/adamw/neg"}
}

ENTRY %main (x: bf16[4,8], finite: pred[]) -> bf16[4,8] {
  %x = bf16[4,8]{1,0} parameter(0)
  %finite = pred[] parameter(1)
  ROOT %conditional = bf16[4,8]{1,0} conditional(%finite, %x, %x), true_computation=%apply, false_computation=%skip
}
"""


def test_a_conditional_counts_its_costliest_branch_once():
    block = 4 * 8 * 2
    assert hbm_traffic.count(CONDITIONAL) == {"optimizer": 2 * 2 * block}  # the update's two fusions, not the skip
    indexed = CONDITIONAL.replace("pred[] parameter(1)", "s32[] parameter(1)").replace(
        "true_computation=%apply, false_computation=%skip", "branch_computations={%skip, %apply}")
    assert hbm_traffic.count(indexed) == {"optimizer": 2 * 2 * block}


def test_a_compiled_step_is_charged_to_the_parts_of_the_model():
    from tests.test_model import params_like_init, small_model
    from andrea_jax import model

    m = small_model(n_layer=1)
    params = params_like_init(m)
    ids = jnp.zeros((2, 16), jnp.int32)
    loss = lambda p: model.Transformer(m).apply({"params": p}, ids).mean()
    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    parts = hbm_traffic.count(hlo)
    assert {"attention", "MLP", "norms", "embeddings, logits and loss"} <= set(parts)
    # The MLP's [2, 16, 256] float32 activations outweigh the norms' [2, 16, 64] ones.
    assert parts["MLP"] > parts["norms"] > 0


def test_an_hlo_text_without_an_entry_is_refused():
    with pytest.raises(ValueError, match="no ENTRY"):
        hbm_traffic.count("HloModule empty\n")
