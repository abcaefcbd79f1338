"""HellaSwag, completion style: each of an example's four endings scored by its log-likelihood after the context.

An example is a context (`ctx`) and four endings, one of them right (`label`).
Each (context, " " + ending) pair is one row of the validation batch [B, L+1]:
its tokens from the start, cut from the left to the L+1 the row holds, padded on
the right (the model is causal, so padding changes nothing before it). The
per-token losses of the rows (`train_step.make_eval_step`'s `per_token`, compiled for the
shape the validation step has) are summed over the ending's tokens alone.

  acc       the ending with the highest total log-likelihood is the label
  acc_norm  the ending with the highest mean log-likelihood per token is the label

(acc_norm as llm.c's hellaswag.py: per token, not lm-eval-harness's per byte.)
Ties go to the lowest-numbered ending. Each comes with its standard error,
sqrt(p(1 - p) / n) over the n examples.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding

from andrea_jax import evaluate, sharding, train_step
from andrea_jax.data import DataError, batcher, sources
from andrea_jax.data.tokenizer import Tokenizer
from andrea_jax.tools.plotting import GPT2_124M_HELLASWAG  # the recipes' target, drawn in the plots

VALIDATION_EXAMPLES = 10_042  # the validation split everyone reports
ENDINGS = 4
OFFLINE_ALTERNATIVES = ("or pass a local hellaswag_val.jsonl (--hellaswag_source=PATH to eval.py, "
                        "--config.hellaswag.source=PATH to train.py; --config.hellaswag.every=0 trains without)")
FORMAT = "HellaSwag's JSONL: one object a line with ctx (text), endings (4 texts) and label (0-3)"


@dataclasses.dataclass(frozen=True, order=True)
class Example:
    context: str
    endings: tuple[str, ...]  # ENDINGS of them
    label: int  # index of the right ending


@dataclasses.dataclass(frozen=True)
class Encoded:
    """The token rows of the examples, four an example (ending e of example i is row 4i + e), unpadded."""
    ids: list[np.ndarray]  # int32: each row's context + ending tokens
    ending_lengths: np.ndarray  # int64 [R]: the row's last tokens that are its ending
    labels: np.ndarray  # int64 [N]
    source_examples: int  # how many the source holds (the rows may be a sample of them)


def _example(row: Any, where: str) -> Example:
    """An Example from one object of the original JSONL; DataError naming `where` otherwise."""
    if not isinstance(row, dict):
        raise DataError(f"{where} is not a JSON object; the file must be {FORMAT}")
    context, endings, label = row.get("ctx"), row.get("endings"), row.get("label")
    if not isinstance(context, str):
        raise DataError(f"{where} has no text field ctx; the file must be {FORMAT}")
    if not (isinstance(endings, list) and len(endings) == ENDINGS and all(isinstance(e, str) for e in endings)):
        raise DataError(f"{where} has no list of {ENDINGS} texts in endings; the file must be {FORMAT}")
    if label is None:
        raise DataError(f"{where} has no label (HellaSwag's test split has none); use the validation "
                        f"split, hellaswag_val.jsonl")
    if isinstance(label, str) and label.strip().isdigit():  # as Hugging Face's copy stores it
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < ENDINGS:
        raise DataError(f"{where} has label {label!r}, not one of 0-{ENDINGS - 1}; the file must be {FORMAT}")
    return Example(context, tuple(endings), label)


def read_jsonl(path: str) -> list[Example]:
    """The examples of a local file in the original format (hellaswag_val.jsonl; that it exists, the config
    checks); read as data only."""
    examples = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path} line {number} is not JSON ({error.msg}); the file must be {FORMAT}") from None
            examples.append(_example(row, f"{path} line {number}"))
    if not examples:
        raise DataError(f"{path} holds no examples; the file must be {FORMAT}")
    return examples


def read_tfds(data_dir: str = "", network_check: Callable[[], bool] = sources.network_available,
              builder: Any = None) -> list[Example]:
    """TFDS's hellaswag validation split (`builder`: TFDS's own), downloaded (12 MB) and prepared on first use;
    offline, a DataError in seconds. The builder reads the original JSONL through etils: no TensorFlow."""
    if builder is None:
        import tensorflow_datasets as tfds

        importlib.import_module("tensorflow_datasets.text.hellaswag")  # registers the builder: tfds does not
        builder = tfds.builder("hellaswag", data_dir=data_dir or None, file_format="array_record")
    sources.ensure_prepared(builder, network_check, instead=OFFLINE_ALTERNATIVES)
    records = sources.open_split(builder, "validation")
    return [Example(r["context"].decode(), tuple(e.decode() for e in r["endings"]), int(r["label"]))
            for r in records.__getitems__(list(range(len(records))))]


def load(source: str, data_dir: str = "") -> list[Example]:
    """The examples `source` names (as `config.hellaswag_source_problem` accepts): tfds:hellaswag's validation
    split, or a JSONL file in the original format; sorted by their text, so that a sample of them is the same
    from either (TFDS stores the records shuffled)."""
    return sorted(read_tfds(data_dir) if source.startswith("tfds:") else read_jsonl(source))


def evenly_spaced(examples: Sequence[Example], count: int) -> list[Example]:
    """`count` examples spread over the whole set (0 or more than there are: all), the same every time."""
    if count <= 0 or count >= len(examples):
        return list(examples)
    return [examples[i] for i in np.arange(count) * len(examples) // count]


def rows_of(examples: Sequence[Example], count: int, tokenizer: Tokenizer) -> Encoded:
    """The four rows of each of `count` of the examples (0 = all of them), evenly spaced: the context's tokens,
    then the ending's, tokenized apart as " " + ending.

    An empty context starts from end-of-text, so that the ending's first token has something to follow.
    """
    source_examples, examples = len(examples), evenly_spaced(examples, count)
    contexts = tokenizer.encode_arrays([e.context for e in examples])
    endings = tokenizer.encode_arrays([" " + ending for e in examples for ending in e.endings])
    ids = []
    for index, context in enumerate(contexts):
        if len(context) == 0:
            if tokenizer.eot_id is None:
                raise DataError(f"HellaSwag example {index} has an empty context and the {tokenizer.kind} "
                                f"tokenizer has no end-of-text token to start from; drop the example")
            context = np.array([tokenizer.eot_id], np.int32)
        ids.extend(np.concatenate([context, ending]) for ending in endings[ENDINGS * index:ENDINGS * (index + 1)])
    return Encoded(ids, np.array([len(e) for e in endings], np.int64), np.array([e.label for e in examples], np.int64),
                   source_examples)


def batch(encoded: Encoded, *, index: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch `index`: int32 [batch_size, seq_len + 1], each row's last seq_len + 1 tokens from its start, zeros
    after, and bool [batch_size, seq_len], the targets that are ending tokens. Past the last row, row 0 again
    (padding, dropped after scoring)."""
    tokens_BxLp1, ending_BxL = np.zeros((batch_size, seq_len + 1), np.int32), np.zeros((batch_size, seq_len), bool)
    for out, row in enumerate(range(index * batch_size, (index + 1) * batch_size)):
        row = row if row < len(encoded.ids) else 0
        ids = encoded.ids[row][-(seq_len + 1):]
        tokens_BxLp1[out, :len(ids)] = ids
        # Target t is token t + 1; of an ending longer than the row, its last tokens.
        ending_BxL[out, max(0, len(ids) - 1 - encoded.ending_lengths[row]):len(ids) - 1] = True
    return tokens_BxLp1, ending_BxL


def cut_rows(encoded: Encoded, seq_len: int) -> dict:
    """How many rows lose tokens to the window: of their context only, or of their ending too."""
    cut = np.array([len(ids) for ids in encoded.ids]) > seq_len + 1
    return {"rows_context_cut": int(np.sum(cut & (encoded.ending_lengths <= seq_len))),
            "rows_ending_cut": int(np.sum(encoded.ending_lengths > seq_len))}


def ending_log_likelihoods(token_loss_step: Callable, params: Any, encoded: Encoded,
                           config: ml_collections.ConfigDict, batch_sharding: NamedSharding
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(each ending's summed log-likelihood [N, 4] in float64, its token count [N, 4]).

    `token_loss_step` is `make_step`'s; every process builds its rows of each batch, as validation does,
    and all get the same figures.
    """
    batch_size, seq_len, rows = int(config.batch_size), int(config.seq_len), len(encoded.ids)
    local = batcher.local_rows(batch_size, jax.process_index(), jax.process_count())
    endings = {}  # batch index -> its ending mask, until its losses come back

    def local_batch(index: int) -> np.ndarray:
        tokens_BxLp1, endings[index] = batch(encoded, index=index, batch_size=batch_size, seq_len=seq_len)
        return tokens_BxLp1[local]

    sums, counts = [], []
    for index, losses_BxL in enumerate(evaluate.scored_batches(token_loss_step, params, local_batch,
                                                               -(-rows // batch_size), batch_sharding)):
        ending_BxL = endings.pop(index)
        sums.append(-np.where(ending_BxL, losses_BxL.astype(np.float64), 0.0).sum(axis=1))
        counts.append(ending_BxL.sum(axis=1))
    return np.concatenate(sums)[:rows].reshape(-1, ENDINGS), np.concatenate(counts)[:rows].reshape(-1, ENDINGS)


def accuracies(log_likelihood_NxE: np.ndarray, tokens_NxE: np.ndarray, labels_N: np.ndarray) -> dict:
    """acc (by total log-likelihood) and acc_norm (by mean per token), with standard errors; ties: the first."""
    n = len(labels_N)
    acc = float(np.mean(np.argmax(log_likelihood_NxE, axis=1) == labels_N))
    acc_norm = float(np.mean(np.argmax(log_likelihood_NxE / tokens_NxE, axis=1) == labels_N))
    return {"acc": acc, "acc_stderr": math.sqrt(acc * (1 - acc) / n),
            "acc_norm": acc_norm, "acc_norm_stderr": math.sqrt(acc_norm * (1 - acc_norm) / n), "examples": n}


def make_step(config: ml_collections.ConfigDict, mesh: Mesh) -> Callable:
    """The jitted per-token loss of a [B, L+1] batch, replicated to every process (under the run's mesh)."""
    return jax.jit(train_step.make_eval_step(config, per_token=True), out_shardings=sharding.replicated(mesh))


def score(token_loss_step: Callable, params: Any, encoded: Encoded, config: ml_collections.ConfigDict,
          batch_sharding: NamedSharding) -> dict:
    """acc, acc_norm and their standard errors over the encoded examples (the loop's and eval.py's)."""
    log_likelihood_NxE, tokens_NxE = ending_log_likelihoods(token_loss_step, params, encoded, config, batch_sharding)
    return {**accuracies(log_likelihood_NxE, tokens_NxE, encoded.labels),
            "source_examples": encoded.source_examples, **cut_rows(encoded, int(config.seq_len))}


def score_on_mesh(params: Any, encoded: Encoded, config: ml_collections.ConfigDict, mesh: Mesh) -> dict:
    """`score` with a step compiled here, for params placed on `mesh` (eval.py, tests)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.rules(config)):
        return score(make_step(config, mesh), params, encoded, config, sharding.batch_sharding(mesh))
