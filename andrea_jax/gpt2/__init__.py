"""GPT-2 weights in and out: Hugging Face's GPT2LMHeadModel and nanoGPT checkpoints."""
