"""HellaSwag: rows packed and masked as specified, log-likelihoods equal to transformers' on the exported model,
a memorising model scores 1, a uniform one follows the tie rule; reading, offline failure, eval.py."""

import json
import math
import os
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from andrea_jax import model, sharding, train_step
from andrea_jax.tools import hellaswag
from andrea_jax.gpt2 import huggingface
from andrea_jax.config import ConfigError, base_config, validate
from andrea_jax.data import DataError
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.tools.hellaswag import Encoded, Example
from tensorflow_datasets.text.hellaswag import Hellaswag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Nine examples (36 rows: the last batch of 8 is half padding), in HellaSwag's shape; the first three contexts
# are longer than the 48-token window of the model below, so they are cut from the left.
LONG = ("A man is standing on a tall ladder in front of a white house with a bucket of paint and a brush, "
        "while his dog runs around the yard and barks at the neighbours who walk past on the road. ")
ROWS = [
    {"ctx": LONG + "The man", "endings": ["paints the wall white.", "eats a sandwich on the roof of a car.",
                                          "swims across the lake.", "plays the piano with his feet."], "label": 0},
    {"ctx": LONG + "The dog", "endings": ["flies away.", "sings.", "keeps barking at the people on the road.",
                                          "reads."], "label": 2},
    {"ctx": LONG + "Then he", "endings": ["cooks.", "climbs down the ladder and cleans the brush.", "sleeps.",
                                          "dances on the table in the kitchen."], "label": 1},
    {"ctx": "A woman ties her shoes. She", "endings": ["runs down the road.", "paints a house.", "barks.",
                                                       "starts to jog along the river."], "label": 3},
    {"ctx": "Two boys kick a ball. They", "endings": ["play football in the yard.", "paint.", "sleep.", "fly."],
     "label": 0},
    {"ctx": "A cook cuts an onion. He", "endings": ["swims.", "puts it in a pan with oil.", "barks at a dog.",
                                                    "runs."], "label": 1},
    {"ctx": "A girl holds a violin. She", "endings": ["eats it.", "paints it.", "plays a slow song.",
                                                      "throws it in the lake."], "label": 2},
    {"ctx": "A man opens a book. He", "endings": ["burns it.", "eats it.", "throws it.", "reads the first page."],
     "label": 3},
    {"ctx": "", "endings": ["The end.", "A start.", "Some middle.", "Nothing."], "label": 0},  # starts from end-of-text
]


def examples():
    return [hellaswag._example(row, f"row {i}") for i, row in enumerate(ROWS)]


def write_jsonl(path, rows=ROWS):
    with open(path, "w") as f:
        for i, row in enumerate(rows):  # the original rows carry more fields; they are ignored
            f.write(json.dumps({"ind": i, "activity_label": "Painting", "ctx_a": row["ctx"], "ctx_b": "",
                                "split": "val", "split_type": "indomain", "source_id": f"activitynet~{i}", **row})
                    + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [row["ctx"] + " " + " ".join(row["endings"]) for row in ROWS]
    return tokenizers.train_bpe(texts * 4, num_merges=60)


def small_config(vocab_size, **overrides):
    c = base_config()
    c.model.update(dict(n_layer=2, d_model=64, n_head=4, mlp_dim=256, max_len=64, vocab_size=vocab_size,
                        vocab_pad_multiple=16))
    c.update(dict(seq_len=48, batch_size=8, steps=120, peak_flops=1e12))
    c.update_from_flattened_dict(overrides)
    return c


def random_params(model_config, seed, scale=0.3):
    shapes = sharding.unbox(jax.eval_shape(lambda key: model.init_params(model_config, key), jax.random.key(0)))
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (scale * rng.standard_normal(s.shape)).astype(np.float32), shapes)


def on_mesh(config, params, devices):
    mesh = sharding.make_mesh(config, devices)
    rules = sharding.rules(config)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(lambda key: model.init_params(config.model, key), jax.random.key(0))
        return mesh, jax.device_put(params, sharding.logical_shardings(boxed, mesh, rules))


def log_likelihoods(config, params, rows, devices):
    """hellaswag.ending_log_likelihoods on a mesh of `devices`."""
    mesh, placed = on_mesh(config, params, devices)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.rules(config)):
        return hellaswag.ending_log_likelihoods(hellaswag.make_step(config, mesh), placed, rows, config,
                                                sharding.batch_sharding(mesh))


# ---------------------------------------------------------------- rows

def hand_encoded():
    """Two examples: rows of 3+2, 1+1, 6+1, 2+5 (context + ending tokens), 4 a row counted by hand."""
    rows = [([1, 2, 3], [4, 5]), ([6], [7]), ([8, 9, 10, 11, 12, 13], [14]), ([15, 16], [17, 18, 19, 20, 21]),
            ([22], [23]), ([24], [25]), ([26], [27]), ([28], [29])]
    return Encoded([np.array(context + ending, np.int32) for context, ending in rows],
                   np.array([len(e) for _, e in rows]), np.array([0, 3]), source_examples=2)


def test_rows_are_cut_from_the_left_padded_on_the_right_and_masked_on_the_ending():
    encoded = hand_encoded()
    tokens, mask = hellaswag.batch(encoded, index=0, batch_size=6, seq_len=4)
    np.testing.assert_array_equal(tokens, [
        [1, 2, 3, 4, 5],  # fits exactly: L + 1 tokens
        [6, 7, 0, 0, 0],
        [10, 11, 12, 13, 14],  # 7 tokens: the context's first two cut
        [17, 18, 19, 20, 21],  # the ending alone is L + 1 tokens: its last 4 can be scored
        [22, 23, 0, 0, 0],
        [24, 25, 0, 0, 0]])
    np.testing.assert_array_equal(mask.astype(int), [
        [0, 0, 1, 1],  # targets 3, 4, 5: 4 and 5 are the ending
        [1, 0, 0, 0],
        [0, 0, 0, 1],
        [1, 1, 1, 1],
        [1, 0, 0, 0],
        [1, 0, 0, 0]])
    assert hellaswag.cut_rows(encoded, seq_len=4) == {"rows_context_cut": 1, "rows_ending_cut": 1}
    # The second batch: rows 6 and 7, then row 0 again as padding (its figures are dropped).
    tokens, mask = hellaswag.batch(encoded, index=1, batch_size=6, seq_len=4)
    np.testing.assert_array_equal(tokens[:, :2], [[26, 27], [28, 29], [1, 2], [1, 2], [1, 2], [1, 2]])
    np.testing.assert_array_equal(mask[:, :2], [[1, 0], [1, 0], [0, 0], [0, 0], [0, 0], [0, 0]])


def test_encode_tokenizes_endings_after_a_space_and_starts_an_empty_context_from_end_of_text(tokenizer):
    encoded = hellaswag.rows_of(examples(), 0, tokenizer)
    assert len(encoded.ids) == 4 * len(ROWS) and list(encoded.labels) == [row["label"] for row in ROWS]
    row = 4 * 3 + 1  # example 3, ending 1
    ids = encoded.ids[row].tolist()
    assert ids == tokenizer.encode(ROWS[3]["ctx"]) + tokenizer.encode(" " + ROWS[3]["endings"][1])
    assert encoded.ending_lengths[row] == len(tokenizer.encode(" paints a house."))
    last = encoded.ids[4 * 8].tolist()
    assert last == [tokenizer.eot_id] + tokenizer.encode(" The end.")
    no_end_of_text = tokenizers.CharTokenizer("".join(r["ctx"] + "".join(r["endings"]) for r in ROWS) + " ",
                                              end_of_text=False)
    with pytest.raises(DataError, match="example 8 has an empty context and the char tokenizer has no end-of-text"):
        hellaswag.rows_of(examples(), 0, no_end_of_text)


def test_evenly_spaced_sample_is_fixed_and_spread():
    many = [Example(str(i), ("a", "b", "c", "d"), i % 4) for i in range(10)]
    assert [e.context for e in hellaswag.evenly_spaced(many, 4)] == ["0", "2", "5", "7"]
    assert hellaswag.evenly_spaced(many, 0) == many and hellaswag.evenly_spaced(many, 99) == many


# ---------------------------------------------------------------- scores

def test_accuracies_take_the_first_of_tied_endings_and_report_standard_errors():
    log_likelihood = np.array([[-4.0, -6.0, -9.0, -8.0],   # sums: 0; means -2, -2, -3, -2: tie 0, 1, 3 -> 0
                               [-3.0, -3.0, -1.0, -5.0],   # sums: 2; means -1.5, -3, -1, -1.25: 2
                               [-2.0, -2.0, -2.0, -2.0]])  # all tied: 0 both ways
    tokens = np.array([[2, 3, 3, 4], [2, 1, 1, 4], [1, 1, 1, 1]])
    result = hellaswag.accuracies(log_likelihood, tokens, np.array([0, 2, 1]))
    assert (result["acc"], result["acc_norm"], result["examples"]) == (pytest.approx(2 / 3), pytest.approx(2 / 3), 3)
    result = hellaswag.accuracies(log_likelihood, tokens, np.array([3, 2, 0]))
    assert result["acc"] == pytest.approx(2 / 3) and result["acc_norm"] == pytest.approx(2 / 3)
    assert result["acc_stderr"] == pytest.approx(math.sqrt(2 / 3 * 1 / 3 / 3))
    result = hellaswag.accuracies(log_likelihood, tokens, np.array([1, 3, 3]))
    assert (result["acc"], result["acc_norm"], result["acc_stderr"]) == (0.0, 0.0, 0.0)


def test_log_likelihoods_equal_transformers_on_the_exported_model(tokenizer, tmp_path):
    """On a (2, 2, 2) mesh with two micro-batches, against GPT2LMHeadModel on the Hugging Face export, tokenized by
    the export's own tokenizer."""
    torch = pytest.importorskip("torch", reason="the reference stack (requirements-reference.txt) is not installed")
    transformers = pytest.importorskip("transformers", reason="the reference stack is not installed")
    config = small_config(tokenizer.vocab_size, microbatches=2, **{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    params = random_params(config.model, seed=5)
    rows = hellaswag.rows_of(examples(), 0, tokenizer)
    ours, tokens = log_likelihoods(config, params, rows, jax.devices())

    huggingface.write_hf(str(tmp_path), params, config.model, tokenizer)
    reference = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    theirs, their_tokens, cut = np.zeros((len(ROWS), 4)), np.zeros((len(ROWS), 4), int), 0
    for i, row in enumerate(ROWS):
        context = hf_tokenizer(row["ctx"])["input_ids"] or [hf_tokenizer.eos_token_id]
        for e, ending in enumerate(row["endings"]):
            ending_ids = hf_tokenizer(" " + ending)["input_ids"]
            ids = (context + ending_ids)[-(config.seq_len + 1):]
            cut += len(context) + len(ending_ids) > len(ids)
            with torch.no_grad():
                logits = reference(torch.tensor([ids[:-1]])).logits[0].double()
            log_probs = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
            theirs[i, e], their_tokens[i, e] = log_probs[-len(ending_ids):].sum(), len(ending_ids)
    assert cut == 12  # the three long contexts were cut to the window
    np.testing.assert_array_equal(tokens, their_tokens)
    assert np.abs(theirs).max() > 10  # a random model: far from uniform, so a wrong offset would show
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-4)
    expected = hellaswag.accuracies(theirs, their_tokens, rows.labels)
    result = hellaswag.accuracies(ours, tokens, rows.labels)
    assert (result["acc"], result["acc_norm"]) == (expected["acc"], expected["acc_norm"])
    assert result["acc"] != result["acc_norm"]  # the two normalisations disagree somewhere on this set


def test_a_model_that_memorised_the_right_endings_scores_one(tokenizer):
    """Trained on the nine right (context, ending) rows until it knows them: every example right, both ways."""
    config = small_config(tokenizer.vocab_size)
    rows = hellaswag.rows_of(examples(), 0, tokenizer)
    right = rows.labels + 4 * np.arange(len(ROWS))  # the row of each right ending
    right_9xLp1 = hellaswag.batch(rows, index=0, batch_size=len(rows.ids), seq_len=config.seq_len)[0][right]
    mesh = sharding.make_mesh(config, jax.devices()[:1])
    tx = optax.adam(1e-2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.rules(config)):
        def train(params):  # one compiled loop of full-batch Adam steps: seconds
            def step(_, carry):
                params, opt_state = carry
                grads = jax.grad(lambda p: train_step.token_losses(p, config.model, right_9xLp1)[0].mean())(params)
                updates, opt_state = tx.update(grads, opt_state)
                return optax.apply_updates(params, updates), opt_state
            return jax.lax.fori_loop(0, 100, step, (params, tx.init(params)))[0]

        params = jax.jit(train)(random_params(config.model, seed=0, scale=0.02))
        loss = jax.jit(lambda p: train_step.token_losses(p, config.model, right_9xLp1)[0].mean())(params)
    assert float(loss) < 0.5
    result = hellaswag.score_on_mesh(params, rows, config, mesh)
    assert (result["acc"], result["acc_norm"], result["acc_stderr"]) == (1.0, 1.0, 0.0)


def test_a_uniform_model_ties_every_ending_and_the_tie_rule_decides(tokenizer):
    """Zero output weights (the tied embedding): every token has log-likelihood -log V, so acc_norm ties on every
    example and takes ending 0, and acc takes the ending of fewest tokens (the first of those)."""
    config = small_config(tokenizer.vocab_size)
    params = random_params(config.model, seed=1)
    params["token_embed"] = np.zeros_like(params["token_embed"])
    rows = hellaswag.rows_of(examples(), 0, tokenizer)
    log_likelihood, tokens = log_likelihoods(config, params, rows, jax.devices()[:1])
    np.testing.assert_allclose(log_likelihood, -tokens * math.log(tokenizer.vocab_size), rtol=1e-6)
    result = hellaswag.accuracies(log_likelihood, tokens, rows.labels)
    shortest = np.argmin(tokens, axis=1)
    assert result["acc_norm"] == pytest.approx(np.mean(rows.labels == 0)) == pytest.approx(3 / 9)
    assert result["acc"] == pytest.approx(np.mean(shortest == rows.labels))
    assert 0 < result["acc"] < 1 and result["acc"] != result["acc_norm"]


# ---------------------------------------------------------------- reading

def test_jsonl_in_the_original_format_reads_and_bad_rows_name_their_line(tmp_path):
    path = write_jsonl(tmp_path / "val.jsonl")
    read = hellaswag.read_jsonl(path)
    assert read == examples() and read[1] == Example(ROWS[1]["ctx"], tuple(ROWS[1]["endings"]), 2)
    for line, message in [("{not json", "line 2 is not JSON"),
                          (json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 0}), "line 2 has no list of 4"),
                          (json.dumps({"ctx": "a", "endings": ["b"] * 4}), "line 2 has no label (HellaSwag's test"),
                          (json.dumps({"ctx": "a", "endings": ["b"] * 4, "label": 4}), "line 2 has label 4, not one"),
                          (json.dumps({"context": "a", "endings": ["b"] * 4, "label": 1}), "line 2 has no text field ctx")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(ROWS[0]) + "\n" + line + "\n")
        with pytest.raises(DataError, match=message.replace("(", r"\(")) as error:
            hellaswag.read_jsonl(str(bad))
        assert "\n" not in str(error.value)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no examples"):
        hellaswag.read_jsonl(str(tmp_path / "empty.jsonl"))


class LocalHellaswag(Hellaswag):
    """TFDS's own HellaSwag builder, its validation split read from a local file instead of downloaded."""
    path = None

    def _split_generators(self, dl_manager):
        return {"validation": self._generate_examples(self.path)}


def test_tfds_builder_records_read_as_the_jsonl_does(tmp_path):
    """TFDS stores them shuffled: `load` sorts either source's examples by their text."""
    LocalHellaswag.path = write_jsonl(tmp_path / "val.jsonl")
    builder = LocalHellaswag(data_dir=str(tmp_path / "tfds"), file_format="array_record")
    from_tfds = hellaswag.read_tfds(network_check=lambda: True, builder=builder)
    assert from_tfds != examples() and sorted(from_tfds) == sorted(examples()) == hellaswag.load(LocalHellaswag.path)


def test_unprepared_tfds_hellaswag_offline_fails_in_seconds_naming_the_local_file(tmp_path, caplog):
    with pytest.raises(DataError) as error:
        hellaswag.read_tfds(str(tmp_path / "tfds"), network_check=lambda: False)
    assert "hellaswag/1.1.0 is not prepared" in str(error.value) and "--hellaswag_source=PATH" in str(error.value)
    # The error line alone: no TFDS warning that the folder it looked in holds no dataset_info.json before it.
    assert [record.getMessage() for record in caplog.records if record.name == "absl"] == []
    assert not os.path.exists(tmp_path / "tfds" / "hellaswag" / "1.1.0" / "dataset_info.json")


def test_config_keys_are_checked(tmp_path):
    config = base_config()
    assert config.hellaswag.every == 0 and config.hellaswag.source == "tfds:hellaswag"
    validate(config)
    for change, message in [({"hellaswag.every": -1}, "hellaswag.every=-1 must be >= 0"),
                            ({"hellaswag.every": 10, "hellaswag.source": str(tmp_path / "no.jsonl")},
                             "no.jsonl' does not exist"),
                            ({"hellaswag.every": 10, "hellaswag.source": "tfds:hellaswag/2"},
                             "the TFDS HellaSwag source is 'tfds:hellaswag'")]:
        bad = base_config()
        bad.update_from_flattened_dict(change)
        with pytest.raises(ConfigError, match=message):
            validate(bad)
    config.update_from_flattened_dict({"hellaswag.every": 10, "hellaswag.source": write_jsonl(tmp_path / "v.jsonl")})
    validate(config)


# ---------------------------------------------------------------- eval.py

@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer):
    """A workdir as train.py leaves it, with random params, and a HellaSwag file beside it."""
    root = tmp_path_factory.mktemp("hellaswag")
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(row["ctx"] + " " + " ".join(row["endings"]) for row in ROWS) * 20)
    config = small_config(tokenizer.vocab_size)
    config.data.update(dict(source=f"text:{corpus}", tokenizer="bpe", val_fraction=0.3, cache_dir=str(root / "c")))
    config.eval_batches = 1
    workdir = str(root / "run")
    os.makedirs(workdir)
    params = random_params(config.model, seed=2)
    huggingface.write_run(workdir, params, config, tokenizer)
    return dict(workdir=workdir, config=config, params=params, jsonl=write_jsonl(root / "val.jsonl"))


def run_eval(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)


def test_eval_py_reports_hellaswag_in_its_json(run, tokenizer):
    result = run_eval("--workdir", run["workdir"], "--hellaswag", f"--hellaswag_source={run['jsonl']}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.load(open(os.path.join(run["workdir"], "eval_step0.json")))["hellaswag"]
    mesh, params = on_mesh(run["config"], run["params"], jax.devices()[:1])
    expected = hellaswag.score_on_mesh(params, hellaswag.rows_of(examples(), 0, tokenizer), run["config"], mesh)
    assert report == {"source": run["jsonl"], **expected}
    assert report["examples"] == report["source_examples"] == 9 and report["rows_context_cut"] == 12
    assert f"HellaSwag acc {report['acc']:.4f} ± {report['acc_stderr']:.4f}, acc_norm" in result.stdout


def test_eval_py_with_a_bad_hellaswag_file_fails_with_one_line_and_writes_nothing(run, tmp_path):
    before = sorted(os.listdir(run["workdir"]))
    missing = run_eval("--workdir", run["workdir"], "--hellaswag", f"--hellaswag_source={tmp_path / 'no.jsonl'}")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n')
    broken = run_eval("--workdir", run["workdir"], "--hellaswag", f"--hellaswag_source={bad}")
    # The path given is named, and the flag it came from not asked for again.
    assert "or pass --hellaswag_source" not in missing.stderr
    for result, message in [(missing, f"HellaSwag file '{tmp_path / 'no.jsonl'}' does not exist; pass the path of "
                                      f"HellaSwag's JSONL (hellaswag_val.jsonl) or 'tfds:hellaswag'"),
                            (broken, "bad.jsonl line 1 has no list of 4 texts in endings")]:
        assert result.returncode == 2
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.stderr
    assert sorted(os.listdir(run["workdir"])) == before


# ---------------------------------------------------------------- training

def test_training_logs_hellaswag_every_n_steps_to_metrics_and_tensorboard(tmp_path):
    from andrea_jax import evaluate, train_loop
    from tests.test_metrics import scalars
    from tests.test_train_loop import loop_config

    source = write_jsonl(tmp_path / "val.jsonl")
    config = loop_config(tmp_path, steps=4, **{"hellaswag.every": 2, "hellaswag.examples": 5,
                                               "hellaswag.source": source})
    workdir = str(tmp_path / "run")
    last = train_loop.train(config, workdir, devices=jax.devices()[:1])
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "hellaswag/acc" in r]
    assert [r["step"] for r in records] == [2, 4]
    keys = ["hellaswag/acc", "hellaswag/acc_stderr", "hellaswag/acc_norm", "hellaswag/acc_norm_stderr"]
    assert all(sorted(r) == sorted(["step"] + keys) for r in records)
    logged = {(step, tag): value for step, tag, value in scalars(workdir) if tag.startswith("hellaswag/")}
    assert logged == {(r["step"], key): pytest.approx(r[key]) for r in records for key in keys}
    # The figures of step 4 are those of its checkpoint, scored apart on five evenly spaced examples.
    restored = evaluate.restore(workdir, evaluate.run_config(workdir))
    rows = hellaswag.rows_of(hellaswag.load(source), 5, restored.tokenizer)
    expected = hellaswag.score_on_mesh(restored.params, rows, restored.config, restored.mesh)
    assert {key: records[-1][key] for key in keys} == {key: expected[key.split("/")[1]] for key in keys}
    assert expected["examples"] == 5 and last["hellaswag/acc"] == records[-1]["hellaswag/acc"]


def test_training_with_an_unreadable_hellaswag_file_stops_before_anything_is_written(tmp_path):
    from andrea_jax import train_loop
    from tests.test_train_loop import loop_config

    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    config = loop_config(tmp_path, **{"hellaswag.every": 2, "hellaswag.source": str(bad)})
    with pytest.raises(DataError, match="bad.jsonl line 1 has no text field ctx"):
        train_loop.train(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert not os.path.exists(tmp_path / "run")
