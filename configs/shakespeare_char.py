"""nanoGPT's CPU recipe for shakespeare_char, for a side-by-side comparison:
4 layers, 4 heads, d_model 128, context 64, batch 12, 2000 steps, lr 1e-3
decayed to 1e-4, character tokens, dropout 0. nanoGPT reaches val loss ~1.88."""

from andrea_jax.config import base_config

# The text nanoGPT's data/shakespeare_char/prepare.py downloads, fetched once into
# data.cache_dir. Offline: --config.data.source=text:PATH/TO/input.txt (a copy of it).
TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


def get_config():
    c = base_config()
    m = c.model
    m.n_layer, m.d_model, m.n_head, m.mlp_dim = 4, 128, 4, 512
    m.max_len = 64
    m.dtype = "auto"  # bfloat16 matmuls where the CPU has them (1.3-1.5x a step), else float32
    m.vocab_size = 0  # the character set of the text + end-of-text
    c.seq_len = 64
    c.batch_size = 12
    c.steps = 2000
    c.log_every = 50
    c.eval_every = 250
    c.eval_batches = 200
    c.checkpoint_every = 1000
    o = c.optimizer
    o.learning_rate = 1e-3
    o.min_learning_rate_ratio = 0.1
    o.warmup_steps = 100
    o.b2 = 0.99
    o.weight_decay = 0.1
    c.data.tokenizer = "char"
    c.data.source = "url:" + TINYSHAKESPEARE_URL
    c.data.val_fraction = 0.1  # the last 10% of the text, nanoGPT's split
    return c
