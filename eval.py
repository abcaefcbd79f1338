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
_BATCHES = flags.DEFINE_integer("batches", None, "Validation batches (default: config.eval_batches; 0 = all)",
                                lower_bound=0)
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue (\"\" = start a new document); none: no sample")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 200, "Most tokens to generate", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Sampling temperature (0 = greedy)", lower_bound=0)
_TOP_K = flags.DEFINE_integer("top_k", 200, "Sample among the k likeliest tokens (0 = all)", lower_bound=0)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Sample among the likeliest tokens holding this mass (1 = all)")
flags.register_validator("top_p", lambda p: 0 < p <= 1, "must be in (0, 1] (1 = no nucleus filter)")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed")
_TRACE = flags.DEFINE_string("trace", None, "Text to trace: what the model predicts after each block (logit lens), "
                             "printed and drawn into <workdir>/trace_step<N>.png")
_HELLASWAG = flags.DEFINE_bool("hellaswag", False, "Also score HellaSwag (completion style: acc, acc_norm)")
_HELLASWAG_SOURCE = flags.DEFINE_string("hellaswag_source", None, "tfds:hellaswag or a path to HellaSwag's JSONL "
                                        "(default: the config's hellaswag.source)")
flags.register_multi_flags_validator(["hellaswag", "hellaswag_source"],
                                     lambda v: v["hellaswag"] or v["hellaswag_source"] is None,
                                     "--hellaswag_source is given without --hellaswag; add --hellaswag to score it")
_HELLASWAG_EXAMPLES = flags.DEFINE_integer("hellaswag_examples", 0, "HellaSwag examples to score, evenly spaced "
                                           "(0 = all)", lower_bound=0)
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


_CONFIG_HELP = ("A config file such as configs/tiny.py, replacing the run's config.json (default: that file); "
                "--config.x=y changes a key of either")


def _define_config_flag(argv: list[str]) -> None:
    """--config is a file when given, else the workdir's config.json, so --config.x=y works on either."""
    if _argument(argv, "config") is not None:
        config_flags.DEFINE_config_file("config", None, _CONFIG_HELP, lock_config=False)
        return
    import ml_collections
    from andrea_jax import UserError, run_dir
    from andrea_jax.runtime import storage
    try:
        workdir = _argument(argv, "workdir")
        with storage.WorkingCopy(workdir or "") as copy:  # of a gs:// workdir: its files, pulled
            saved = run_dir.load_saved_config(copy.local) if workdir and os.path.isdir(copy.local) else None
    except UserError:
        saved = None  # main() reports it
    config_flags.DEFINE_config_dict("config", saved or ml_collections.ConfigDict(), _CONFIG_HELP, lock_config=False)


def _hellaswag_rows(restored, leader: bool):
    """(source, the token rows of the HellaSwag examples to score): --hellaswag_source, else the config's."""
    from andrea_jax.tools import hellaswag
    from andrea_jax.config import hellaswag_source_problem
    from andrea_jax.data import DataError
    from andrea_jax.runtime.leader_first import leader_first
    source = _HELLASWAG_SOURCE.value or str(restored.config.hellaswag.source)
    problem = hellaswag_source_problem(source)
    if problem:  # the run's own source may be another machine's path: another can be passed
        raise DataError(problem if _HELLASWAG_SOURCE.value else f"{problem} (the run's hellaswag.source); "
                                                                 f"or pass --hellaswag_source")
    read = lambda: hellaswag.load(source, restored.config.data.tfds_data_dir)  # process 0 prepares TFDS's copy
    examples = leader_first(leader, read, read, "prepare the HellaSwag examples")
    return source, hellaswag.rows_of(examples, _HELLASWAG_EXAMPLES.value, restored.tokenizer)


def main(argv):
    del argv
    cli.run(_evaluate, verbosity=logging.ERROR)  # Orbax warns about read-only managers


def _evaluate() -> None:
    import jax
    from andrea_jax.runtime import storage

    leader = jax.process_index() == 0
    # Of a gs:// workdir its files, pulled; process 0 writes back what it wrote.
    written = lambda name: leader and name.startswith(("eval_step", "trace_step", "metrics.png"))
    with storage.WorkingCopy(_WORKDIR.value, owns=written) as copy:
        _evaluate_in(copy.local, leader)


def _evaluate_in(workdir: str, leader: bool) -> None:
    import jax
    from andrea_jax import UserError, evaluate
    from andrea_jax.runtime import storage
    from andrea_jax.runtime.leader_first import leader_first

    # The run's own config.json (with any --config.x=y) unless --config names a file; empty: no run here.
    restored = evaluate.restore(workdir, flags.FLAGS.config or None, _STEP.value)
    batches = restored.config.eval_batches if _BATCHES.value is None else _BATCHES.value
    # As in training: the leader builds a missing validation cache, the others then read it.
    find_split = lambda build: evaluate.validation_split(restored.config, restored.tokenizer, build)
    split = leader_first(leader, lambda: find_split(True), lambda: find_split(False), "build the validation token cache")
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
    say(f"wrote {path and storage.shown(path)}", flush=True)
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
        with jax.set_mesh(restored.mesh):
            table = logit_lens.trace(restored.params, restored.config.model, restored.tokenizer, _TRACE.value, png)
        say(table)
        say(f"wrote {png and storage.shown(png)}", flush=True)
    if _PLOT.value and leader:
        from andrea_jax.tools import plotting
        try:
            say(f"wrote {storage.shown(plotting.plot_run(workdir))}", flush=True)
        except UserError as error:  # no training records yet: the evaluation stands
            say(f"note: no plot: {error}", flush=True)


if __name__ == "__main__":
    with cli.one_line_flag_errors():  # --config.x=y is applied to a workdir's config here
        _define_config_flag(sys.argv)
    cli.run_app(main)
