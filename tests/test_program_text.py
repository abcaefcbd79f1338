"""compile.program_text: two traces of one program compare equal, a changed instruction does not."""

import jax
import jax.numpy as jnp
import pytest

from andrea_jax.compile.program_text import without_source_info

X, W = jnp.ones((4, 8)), jnp.ones((8, 8))


def compiled(activation):
    return jax.jit(lambda x, w: activation(x @ w).sum()).lower(X, W).compile().as_text()


@pytest.fixture
def compiled_afresh():
    """The suite's persistent compilation cache would hand the second trace the first's executable and text."""
    from jax._src import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # it is read again at the next compile
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def test_the_same_program_traced_from_other_lines_compares_equal(compiled_afresh):
    first = compiled(jnp.tanh)
    second = jax.jit(
        lambda x, w:
        jnp.tanh(x @ w).sum()  # the same program, from other lines and columns
    ).lower(X, W).compile().as_text()
    assert first != second and "FileNames" in first and "metadata={" in first
    assert without_source_info(first) == without_source_info(second)
    kept = without_source_info(first)
    assert "ENTRY" in kept and " tanh(" in kept and kept.startswith("HloModule ")
    for removed in ("FileNames", "FunctionNames", "FileLocations", "StackFrames", "metadata=", "stack_frame_id"):
        assert removed not in kept


def test_a_changed_instruction_is_told_apart_where_the_header_alone_was_not():
    tanh, sine = compiled(jnp.tanh), compiled(jnp.sin)
    assert tanh.split("FileNames")[0] == sine.split("FileNames")[0]  # the old comparison: the header only
    assert without_source_info(tanh) != without_source_info(sine)
    kept_tanh, kept_sine = without_source_info(tanh).splitlines(), without_source_info(sine).splitlines()
    changed = [(a, b) for a, b in zip(kept_tanh, kept_sine) if a != b]
    assert len(kept_tanh) == len(kept_sine) and changed  # the instruction, its uses, its fusion's name
    assert all("tanh" in a and "sin" in b and "metadata" not in a + b for a, b in changed)


def test_metadata_with_braces_in_a_quoted_name_goes_whole():
    line = '  %add.1 = f32[] add(%a, %b), metadata={op_name="jit(f)/dict{k}/add" stack_frame_id=2}, sharding={replicated}\n'
    assert without_source_info(line) == "  %add.1 = f32[] add(%a, %b), sharding={replicated}\n"
