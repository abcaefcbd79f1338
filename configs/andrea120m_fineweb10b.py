"""ANDREA-120M on 10B tokens of FineWeb-Edu: the recipe for GPT-2 124M's HellaSwag (acc_norm 0.2955)
on one accelerator. llm.c's GPT-2 124M run: 19,073 steps of 524,288 tokens, learning rate 6e-4
after 700 warmup steps, cosine to a tenth, weight decay 0.1 (README, "The recipes"; per chip, docs/chips.md and docs/data.md)."""

from configs import andrea120m


def get_config():
    c = andrea120m.get_config()  # the exact model, dtype and attention chosen for the chip
    c.batch_size = 512  # × 1024 tokens = 524,288 a step, in the micro-batches the device's memory allows
    c.seq_len = 1024
    c.steps = 19_073  # × 524,288 = 10.0B tokens
    c.optimizer.learning_rate = 6e-4
    c.optimizer.warmup_steps = 700
    c.optimizer.decay = "cosine"
    c.optimizer.min_learning_rate_ratio = 0.1
    c.optimizer.weight_decay = 0.1
    c.data.source = "hf:HuggingFaceFW/fineweb-edu/sample-10BT"
    c.data.val_split = "validation"  # the dataset has none: validation is its first documents, never trained on
    c.data.stream_val_documents = 10_000  # about 12M tokens, more than the 20 batches an evaluation reads
    # 10.0B tokens, each read once: 149 eras of 64M tokens encoded beside training, at most 5 on disk at once
    c.data.stream_tokens = 10_000_000_000
    c.log_every = 10
    c.eval_every = 250
    c.eval_batches = 20
    # 250 steps are minutes on a TPU or an A100 (docs/chips.md's table): what an ended session loses at most.
    # Two checkpoints of 1.1 GB each (parameters and both moments in float32) stay in the workdir.
    c.checkpoint_every = 250
    c.keep_checkpoints = 2
    # A fixed sample of 2,000 examples every 1,000 steps; `eval.py --hellaswag` scores all 10,042 at the end.
    c.hellaswag.every = 1000
    c.hellaswag.examples = 2000
    return c
