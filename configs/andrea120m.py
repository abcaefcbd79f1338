"""ANDREA-120M: the exact model of the spec (92,331,264 parameters), set up for a
real run on one accelerator (a Colab GPU or TPU); scale batch_size with devices."""

from andrea_jax.config import base_config


def get_config():
    c = base_config()  # the model section already is the exact ANDREA-120M
    c.model.dtype = "auto"  # bfloat16 on TPUs and NVIDIA GPUs from the A100 on
    c.model.attention = "auto"  # the Pallas splash kernel on TPUs, cuDNN's fused attention on GPUs
    c.steps = 20_000
    c.batch_size = 32  # × 1024 tokens = 32k tokens a step
    c.seq_len = 1024
    c.microbatches = 0  # the fewest micro-batches that fit the device's memory, chosen by compiling
    c.log_every = 20
    c.eval_every = 500
    c.eval_batches = 40
    c.checkpoint_every = 1000
    c.keep_checkpoints = 3
    c.optimizer.learning_rate = 6e-4
    c.optimizer.warmup_steps = 700
    c.data.source = "tfds:lm1b"  # prepares without Beam; TensorFlow reads its download (the notebook installs it)
    c.data.val_split = "test"  # lm1b has no validation split
    c.data.tokenizer = "bpe"
    return c
