"""Evaluate a run: python eval.py --workdir runs/tiny [--step N] [--batches N] [--hellaswag] [--prompt "def "]

Restores the params of the newest (or --step) checkpoint onto the devices present,
reports validation loss, perplexity and bits per byte (also written to
<workdir>/eval_step<N>.json), with --hellaswag HellaSwag's accuracy (in the same
file) and, with --prompt, samples a continuation. The config
is the run's own config.json; --config FILE replaces it, --config.x=y changes a key.
"""

import os
import sys

from absl import flags, logging
from ml_collections import config_flags

from andrea_jax.runtime import cli  # the multi-process flags, shared with train.py

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by train.py")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to evaluate (default: the newest)")
_BATCHES = flags.DEFINE_integer("batches", None, "Validation batches (default: config.eval_batches; 0 = all)")
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue (\"\" = start a new document); none: no sample")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 200, "Most tokens to generate")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature (0 = greedy)")
_TOP_K = flags.DEFINE_integer("top_k", 200, "Sample among the k likeliest tokens (0 = all)")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Sample among the likeliest tokens holding this mass (1 = all)")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed")
_TRACE = flags.DEFINE_string("trace", None, "Text to trace: what the model predicts after each block (logit lens), "
                             "printed and drawn into <workdir>/trace_step<N>.png")
_HELLASWAG = flags.DEFINE_bool("hellaswag", False, "Also score HellaSwag (completion style: acc, acc_norm)")
_HELLASWAG_SOURCE = flags.DEFINE_string("hellaswag_source", None, "tfds:hellaswag or a path to HellaSwag's JSONL "
                                        "(default: the config's hellaswag.source)")
_HELLASWAG_EXAMPLES = flags.DEFINE_integer("hellaswag_examples", 0, "HellaSwag examples to score, evenly spaced "
                                           "(0 = all)")
_PLOT = flags.DEFINE_bool("plot", False, "Also draw the run's metrics.jsonl into <workdir>/metrics.png")
flags.mark_flags_as_required(["workdir"])


def _argument(argv: list[str], name: str) -> str | None:
    """The value of --name in argv (before absl parses it)."""
    for index, argument in enumerate(argv):
        if argument == f"--{name}" and index + 1 < len(argv):
            return argv[index + 1]
        if argument.startswith(f"--{name}="):
            return argument.split("=", 1)[1]
    return None


def _define_config_flag(argv: list[str]) -> None:
    """--config is a file when given, else the workdir's config.json, so --config.x=y works on either."""
    if _argument(argv, "config") is not None:
        config_flags.DEFINE_config_file("config", None, "Config file replacing the run's config.json",
                                        lock_config=False)
        return
    from andrea_jax import run_dir
    from andrea_jax.config import ConfigError
    import ml_collections
    try:
        workdir = _argument(argv, "workdir")
        saved = run_dir.load_saved_config(workdir) if workdir and os.path.isdir(workdir) else None
    except ConfigError:
        saved = None  # main() reports it
    config_flags.DEFINE_config_dict("config", saved or ml_collections.ConfigDict(), lock_config=False)


def _check_flags() -> str | None:
    if _MAX_NEW_TOKENS.value < 1:
        return f"--max_new_tokens={_MAX_NEW_TOKENS.value} must be at least 1"
    if _TEMPERATURE.value < 0:
        return f"--temperature={_TEMPERATURE.value} must be >= 0 (0 = greedy)"
    if _TOP_K.value < 0:
        return f"--top_k={_TOP_K.value} must be >= 0 (0 = no top-k filter)"
    if not 0 < _TOP_P.value <= 1:
        return f"--top_p={_TOP_P.value} must be in (0, 1] (1 = no nucleus filter)"
    if _BATCHES.value is not None and _BATCHES.value < 0:
        return f"--batches={_BATCHES.value} must be >= 0 (0 = the whole split)"
    if _HELLASWAG_EXAMPLES.value < 0:
        return f"--hellaswag_examples={_HELLASWAG_EXAMPLES.value} must be >= 0 (0 = all)"
    if _HELLASWAG_SOURCE.value is not None:
        from andrea_jax.config import hellaswag_source_problem
        problem = hellaswag_source_problem(_HELLASWAG_SOURCE.value)
        if problem:
            return f"--hellaswag_source: {problem}"
        if not _HELLASWAG.value:
            return "--hellaswag_source is given without --hellaswag; add --hellaswag to score it"
    return None


def _hellaswag_rows(restored, leader: bool):
    """(source, the token rows of the HellaSwag examples to score): --hellaswag_source, else the config's."""
    from andrea_jax.tools import hellaswag
    from andrea_jax.config import hellaswag_source_problem
    from andrea_jax.data import DataError
    from andrea_jax.runtime.leader_first import leader_first
    source = _HELLASWAG_SOURCE.value or str(restored.config.hellaswag.source)
    problem = hellaswag_source_problem(source)
    if problem:
        raise DataError(f"{problem}; or pass --hellaswag_source")
    read = lambda: hellaswag.load(source, restored.config.data.tfds_data_dir)  # process 0 prepares TFDS's copy
    examples = leader_first(leader, read, read, "prepare the HellaSwag examples")
    return source, hellaswag.rows_of(examples, _HELLASWAG_EXAMPLES.value, restored.tokenizer)


def main(argv):
    del argv
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.ERROR)  # Orbax warns about read-only managers
    workdir = _WORKDIR.value
    # The cheap checks first: no JAX start-up to learn that a path is wrong.
    problem = _check_flags()
    if problem is None and not os.path.isdir(workdir):
        problem = f"--workdir {workdir} does not exist; pass the directory train.py wrote"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)

    import jax
    from andrea_jax import checkpoint, evaluate
    from andrea_jax.runtime import distributed
    from andrea_jax.config import ConfigError
    from andrea_jax.data import DataError
    from andrea_jax.runtime.leader_first import leader_first
    try:
        distributed.initialize(cli.COORDINATOR.value, cli.NUM_PROCESSES.value, cli.PROCESS_ID.value,
                               cli.DISTRIBUTED_TIMEOUT.value)
        leader = jax.process_index() == 0
        if _argument(sys.argv, "config") is None:
            evaluate.run_config(workdir)  # raises when the workdir holds no run
        restored = evaluate.restore(workdir, flags.FLAGS.config, _STEP.value)
        batches = restored.config.eval_batches if _BATCHES.value is None else _BATCHES.value
        # As in training: the leader builds a missing validation cache, the others then read it.
        find_split = lambda: evaluate.validation_split(restored.config, restored.tokenizer)
        split = leader_first(leader, find_split, find_split, "build the validation token cache")
        # Read before anything is scored or written: a bad file stops here.
        source, rows = _hellaswag_rows(restored, leader) if _HELLASWAG.value else (None, None)
        report = evaluate.score(restored, split, batches)
        if _HELLASWAG.value:
            from andrea_jax.tools import hellaswag
            report["hellaswag"] = {"source": source, **hellaswag.score_on_mesh(restored.params, rows,
                                                                                  restored.config, restored.mesh)}
        # Every process takes part in each computation (scoring, sampling); the leader reports.
        say = print if leader else (lambda *args, **kwargs: None)
        path = evaluate.write_report(workdir, report) if leader else None
        say(f"step {report['step']}: val loss {report['loss']:.4f}, perplexity {report['perplexity']:.2f}, "
              f"bits per byte {report['bits_per_byte']:.4f} over {report['tokens']:,} tokens "
              f"({100 * report['fraction_of_split']:.1f}% of the split, {report['batches']} batches) "
              f"on {report['mesh']}")
        if _HELLASWAG.value:
            h = report["hellaswag"]
            say(f"step {report['step']}: HellaSwag acc {h['acc']:.4f} ± {h['acc_stderr']:.4f}, acc_norm "
                f"{h['acc_norm']:.4f} ± {h['acc_norm_stderr']:.4f} over {h['examples']:,} of the "
                f"{h['source_examples']:,} examples of {source} (completion style; acc_norm: mean per token)")
        say(f"wrote {path}", flush=True)
        if _PROMPT.value is not None:
            text = evaluate.continue_text(restored, _PROMPT.value, max_new_tokens=_MAX_NEW_TOKENS.value,
                                          temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
                                          seed=_SEED.value)
            say(f"--- sample (temperature {_TEMPERATURE.value}, top_k {_TOP_K.value}, top_p {_TOP_P.value}, "
                  f"seed {_SEED.value}) ---")
            say(_PROMPT.value + text, flush=True)
        if _TRACE.value is not None:
            from andrea_jax.tools import logit_lens
            png = os.path.join(workdir, f"trace_step{report['step']}.png") if leader else None
            try:
                with jax.set_mesh(restored.mesh):
                    table = logit_lens.trace(restored.params, restored.config.model, restored.tokenizer,
                                             _TRACE.value, png)
            except ValueError as error:  # an empty text
                raise evaluate.EvalError(str(error)) from error
            say(table)
            say(f"wrote {png}", flush=True)
        if _PLOT.value and leader:
            from andrea_jax.tools import plotting
            try:
                say(f"wrote {plotting.plot_run(workdir)}", flush=True)
            except ValueError as error:  # no training records yet
                say(f"note: no plot: {error}", flush=True)
    except (ConfigError, DataError, checkpoint.CheckpointError, evaluate.EvalError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    with cli.one_line_flag_errors():  # --config.x=y is applied to a workdir's config here
        _define_config_flag(sys.argv)
    cli.run_app(main)
