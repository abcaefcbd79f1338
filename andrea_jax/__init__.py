"""ANDREA: a JAX/Flax trainer for GPT-2-class transformers."""


class UserError(Exception):
    """A mistake the user can fix; the message names the fix. Every entry point prints it as one line."""


def first_line(error: BaseException) -> str:
    """An error as one line of a message: its type and the start of its first line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:160]}" if text else type(error).__name__
