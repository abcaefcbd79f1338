"""The data pipeline: text source -> tokenizer -> token cache -> batches.

`pipeline.prepare` runs the first three once per run; `batcher` turns a cached
token stream into the batches of a step, as a pure function of (seed, step).
"""

from andrea_jax import UserError


class DataError(UserError):
    """Input the pipeline cannot use; the message names the fix."""
