"""ANDREA: a JAX/Flax trainer for GPT-2-class transformers."""


class UserError(Exception):
    """A mistake the user can fix; the message names the fix. Every entry point prints it as one line."""
