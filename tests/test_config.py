"""Every config loads, and impossible ones stop with a line that names the fix."""

import importlib.util
import pathlib
import re

import jax
import pytest

from andrea_jax.config import ConfigError, base_config, padded_vocab_size, validate
from andrea_jax.sharding import make_mesh, mesh_shape

CONFIGS = sorted(pathlib.Path(__file__).parent.parent.joinpath("configs").glob("*.py"))
REQUIRED_KEYS = ["seed", "steps", "batch_size", "seq_len", "checkpoint_every", "keep_checkpoints",
                 "eval_every", "log_every", "model.n_layer", "model.d_model", "model.n_head",
                 "model.mlp_dim", "model.vocab_size", "model.max_len", "model.dtype", "data.source",
                 "data.tokenizer", "mesh.data", "mesh.fsdp", "mesh.tensor"]


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_files_load_validate_and_have_every_key(path):
    config = load(path)
    validate(config)
    for key in REQUIRED_KEYS:
        node = config
        for part in key.split("."):
            node = node[part]


def test_config_files_are_the_expected_models():
    configs = {p.stem: load(p) for p in CONFIGS}
    assert {"andrea120m", "tiny", "shakespeare_char"} <= configs.keys()
    m = configs["andrea120m"].model
    assert (m.n_layer, m.d_model, m.n_head, m.mlp_dim, m.vocab_size, m.max_len) == (12, 768, 12, 3072, 8449, 1024)
    assert m.vocab_pad_multiple == 1 and m.dropout == 0.0
    s = configs["shakespeare_char"]
    assert (s.model.n_layer, s.model.n_head, s.model.d_model, s.seq_len, s.batch_size, s.steps) == \
        (4, 4, 128, 64, 12, 2000)
    assert s.optimizer.learning_rate == 1e-3 and s.data.tokenizer == "char"
    # nanoGPT's text, fetched into the data cache: nothing outside a fresh clone is needed.
    assert s.data.source == ("url:https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                             "tinyshakespeare/input.txt") and s.data.val_fraction == 0.1
    assert configs["tiny"].data.source == "stdlib"


@pytest.mark.parametrize("change, message", [
    (dict(model=dict(n_head=5)), "n_head=5 does not divide model.d_model=768; pick a divisor such as 64"),
    (dict(seq_len=2048), "seq_len=2048 exceeds model.max_len=1024"),
    (dict(model=dict(dtype="float8")), "model.dtype='float8' is not one of"),
    (dict(model=dict(attention="flash")), "model.attention='flash' is not one of 'auto', 'xla', 'cudnn', 'splash'"),
    (dict(optimizer=dict(decay="step")), "optimizer.decay='step'"),
    (dict(mesh=dict(data=-1, fsdp=-1)), "only one of mesh.data"),
    (dict(steps=0), "steps=0 must be >= 1"),
    (dict(optimizer=dict(grad_clip_norm=0.0)), "a clip of 0 zeroes every gradient"),
    (dict(data=dict(val_fraction=0.0)), "data.val_fraction=0.0 must be in (0, 0.5]"),
    (dict(data=dict(stream_tokens=-1)), "data.stream_tokens=-1 must be >= 0 (0 = what the steps read: exactly their "
                                         "windows in data.order='epochs', a tenth more in 'random')"),
    (dict(data=dict(stream_val_documents=0)), "data.stream_val_documents=0 must be >= 1"),
    (dict(optimizer=dict(name="sgd")), "optimizer.name='sgd' is not one of 'adamw', 'muon'"),
    (dict(optimizer=dict(decay="wsd", cooldown_shape="cosine")), "optimizer.cooldown_shape='cosine' is not one of"),
    (dict(optimizer=dict(decay="wsd", cooldown_steps=9_501)),
     "optimizer.cooldown_steps=9501 must be from 1 to the 9500 steps after warmup with decay='wsd'"),
    (dict(optimizer=dict(decay="wsd")), "optimizer.cooldown_steps=0 must be from 1 to the 9500 steps"),
    (dict(optimizer=dict(cooldown_steps=-1)), "optimizer.cooldown_steps=-1 must be >= 0"),
    (dict(optimizer=dict(learning_rate=float("nan"))), "optimizer.learning_rate=nan must be a finite number in (0, inf)"),
    (dict(optimizer=dict(learning_rate=-1e-3)), "optimizer.learning_rate=-0.001 must be a finite number in (0, inf)"),
    (dict(optimizer=dict(learning_rate=float("inf"))), "optimizer.learning_rate=inf must be a finite"),
    (dict(optimizer=dict(b1=1.0)), "optimizer.b1=1.0 must be a finite number in [0, 1)"),
    (dict(optimizer=dict(b2=-0.1)), "optimizer.b2=-0.1 must be a finite number in [0, 1)"),
    (dict(optimizer=dict(eps=0.0)), "optimizer.eps=0.0 must be a finite number in (0, inf)"),
    (dict(optimizer=dict(weight_decay=float("nan"))), "optimizer.weight_decay=nan must be a finite number in [0, inf)"),
    (dict(optimizer=dict(min_learning_rate_ratio=float("nan"))), "optimizer.min_learning_rate_ratio=nan must be"),
    (dict(optimizer=dict(muon_momentum=1.0)), "optimizer.muon_momentum=1.0 must be a finite number in [0, 1)"),
    (dict(optimizer=dict(muon_ns_steps=0)), "optimizer.muon_ns_steps=0 must be >= 1"),
    (dict(optimizer=dict(muon_ns_dtype="float16")), "optimizer.muon_ns_dtype='float16' is not one of 'auto', 'float32', 'bfloat16'"),
])
def test_impossible_configs_name_the_fix(change, message):
    config = base_config()
    config.update_from_flattened_dict(_flatten(change))
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_mesh_shape_fills_minus_one_and_rejects_misfits():
    config = base_config()
    config.mesh.update(dict(data=-1, fsdp=2, tensor=2))
    assert mesh_shape(config.mesh, 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match="does not divide 6"):
        mesh_shape(config.mesh, 6)
    config.mesh.update(dict(data=2, fsdp=2, tensor=1))
    with pytest.raises(ConfigError, match="needs 4 devices but 8 are present"):
        mesh_shape(config.mesh, 8)


@pytest.mark.parametrize("batch_size, microbatches, mesh_data, parts, multiple", [
    (10, 4, 1, "4 × 1 × 1", 4),  # micro-batches that do not divide the batch
    (12, 0, 8, "1 × 8 × 1", 8),  # a batch that does not split over the devices
    (16, 4, 8, "4 × 8 × 1", 32),  # micro-batches of 4 rows over 8 devices
])
def test_a_batch_that_does_not_split_stops_at_the_mesh_naming_the_fix(batch_size, microbatches, mesh_data, parts,
                                                                      multiple):
    config = base_config()
    config.update(dict(batch_size=batch_size, microbatches=microbatches))
    config.mesh.data = mesh_data
    validate(config)  # the split needs the devices: it is checked once, by the mesh
    with pytest.raises(ConfigError) as error:
        make_mesh(config, jax.devices()[:mesh_data])
    message = str(error.value)
    assert f"microbatches × mesh.data × mesh.fsdp = {parts}; make it a multiple of {multiple}" in message
    assert "\n" not in message
    config.batch_size = 2 * multiple
    assert make_mesh(config, jax.devices()[:mesh_data]).shape["data"] == mesh_data


def test_vocab_padding():
    m = base_config().model
    assert padded_vocab_size(m) == 8449
    m.vocab_pad_multiple = 128
    assert padded_vocab_size(m) == 8576


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + k + "."))
        else:
            out[prefix + k] = v
    return out


def test_the_fineweb10b_recipe_is_llm_c_schedule_on_ten_billion_tokens():
    from configs import andrea120m_fineweb10b

    c = andrea120m_fineweb10b.get_config()
    validate(c)
    tokens_a_step = c.batch_size * c.seq_len
    assert tokens_a_step == 524_288 and c.steps * tokens_a_step >= 9.5e9 and c.microbatches == 0
    o = c.optimizer
    assert (o.learning_rate, o.warmup_steps, o.decay, o.min_learning_rate_ratio, o.weight_decay) == (
        6e-4, 700, "cosine", 0.1, 0.1)
    assert c.data.source == "hf:HuggingFaceFW/fineweb-edu/sample-10BT" and c.data.stream_tokens * 2 == 20e9
    assert 1000 <= c.hellaswag.every <= 2000 and c.hellaswag.examples == 2000
    assert c.checkpoint_every <= 250 and c.model.d_model == 768 and c.model.vocab_size == 8449


def test_the_fineweb5b_recipe_is_muon_with_wsd_on_five_billion_tokens():
    from configs import andrea120m_fineweb5b, andrea120m_fineweb10b

    c, llmc = andrea120m_fineweb5b.get_config(), andrea120m_fineweb10b.get_config()
    validate(c)
    tokens = c.steps * c.batch_size * c.seq_len
    assert tokens == pytest.approx(5.0e9, rel=0.001) and tokens <= c.data.stream_tokens
    o = c.optimizer
    assert (o.name, o.decay, o.cooldown_shape) == ("muon", "wsd", "1-sqrt")
    assert o.learning_rate == pytest.approx(6 * llmc.optimizer.learning_rate)  # the optimizer study's tiny rows
    assert o.cooldown_steps == round(0.2 * c.steps) and o.min_learning_rate_ratio == 0.1
    # The rest is llm.c's recipe: model, data, batch and evaluation side by side.
    assert c.data.source == llmc.data.source
    for key in ("model", "batch_size", "seq_len", "hellaswag", "eval_every", "checkpoint_every"):
        assert c[key] == llmc[key]


def test_the_readme_says_what_stream_tokens_0_takes_as_the_config_does():
    with open(pathlib.Path(__file__).parent.parent / "README.md", encoding="utf-8") as f:
        row = next(line for line in f if line.startswith("| `data.stream_tokens`"))
    assert "(0 = what the steps read: exactly their windows in `data.order='epochs'`, a tenth more in `'random'`)" in row


def test_the_readme_budget_for_more_fineweb5b_steps_covers_them_in_one_epoch():
    """The README's `--config.steps=11444 --config.data.stream_tokens=...`: the new eras follow the 5.1B budget's,
    and the first epoch holds every window the 11,444 steps read."""
    from configs import andrea120m_fineweb5b
    from andrea_jax.data import eras, order

    with open(pathlib.Path(__file__).parent.parent / "README.md", encoding="utf-8") as f:
        advice = re.search(r"--config\.steps=(\d+) --config\.data\.stream_tokens=(\d+)", f.read())
    steps, tokens = map(int, advice.groups())
    c = andrea120m_fineweb5b.get_config()
    raised = order.Layout(tokens, c.seq_len, eras.era_tokens(c.data, c.seq_len), c.seed, breaks=(c.data.stream_tokens,))
    assert steps * c.batch_size * c.seq_len == pytest.approx(6.0e9, rel=0.001)
    assert steps * c.batch_size <= raised.windows_in_epoch(0) < steps * c.batch_size * 1.02
