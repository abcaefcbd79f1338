"""A small ANDREA that trains in 10-60 minutes on 2 CPU cores (README, Quick start), on the Python standard
library's own source (on every machine, no download), with the real 8449-entry
BPE tokenizer."""

from andrea_jax.config import base_config


def get_config():
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim = 4, 256, 4, 1024
    m.max_len = 256
    m.dtype = "auto"  # bfloat16 matmuls where the CPU has them (1.3-1.5x a step), else float32
    c.seq_len = 128
    c.batch_size = 16
    c.steps = 1000
    c.log_every = 10
    c.eval_every = 200
    c.eval_batches = 10
    c.checkpoint_every = 200
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 100
    c.optimizer.b2 = 0.99
    c.data.source = "stdlib"
    c.data.tokenizer = "bpe"
    c.data.tokenizer_train_bytes = 8_000_000  # a bounded sample keeps BPE training to seconds
    return c
