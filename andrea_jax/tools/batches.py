"""What a step read: python -m andrea_jax.tools.batches --workdir W --steps A:B [--text] [--json]

Steps are numbered as the log numbers them (step 1 is the first). For each step, its windows in the
order of the batch's rows: the era and the window's first token as an offset in the training split's
token stream. With --text, the start of each window's text (its era must be on disk); with --json, one
object a line: {"step": s, "windows": [[era, offset], ...]}. Reads the workdir's records only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from andrea_jax import UserError, run_dir
from andrea_jax.data import DataError, batcher, eras, pipeline
from andrea_jax.data import tokenizer as tokenizers
from andrea_jax.runtime import storage

_TEXT_CHARACTERS = 60


def step_range(text: str) -> range:
    """'A:B' (steps A to B, as the log numbers them) or 'A'."""
    try:
        first, _, last = text.partition(":")
        steps = range(int(first), int(last or first) + 1)
    except ValueError:
        steps = range(0)
    if not steps or steps.start < 1:
        raise UserError(f"--steps {text!r} is not A:B or A with 1 <= A <= B (steps as the log numbers them)")
    return steps


class RunWindows:
    """The windows of a run's steps, from its workdir: (era, offset in the split) and their text when on disk."""

    def __init__(self, workdir: str) -> None:
        config = run_dir.load_saved_config(workdir)
        record_path = os.path.join(workdir, pipeline.RECORD_FILE)
        if config is None or not os.path.exists(record_path):
            raise DataError(f"{workdir} holds no run that prepared its data ({pipeline.RECORD_FILE} is missing); "
                            f"pass the --workdir train.py wrote")
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        self.config, self.workdir = config, workdir
        self.seed, self.seq_len, self.batch_size = int(config.seed), int(config.seq_len), int(config.batch_size)
        eras_record = os.path.join(workdir, eras.RECORD_FILE)
        if "train_eras" in record:
            self.cache = eras.EraCache(**record["train_eras"], record_path=eras_record)
        else:  # recorded before every training split was eras: a finite one's whole cache, one era
            directory = record["cache_directories"]["train"]
            try:
                with open(os.path.join(directory, "train.json"), encoding="utf-8") as f:
                    self.cache = eras.EraCache(directory, eras_record, 0, int(json.load(f)["num_tokens"]))
            except (OSError, ValueError, KeyError) as error:
                raise DataError(f"the training cache of {workdir} is unreadable ({error}); run train.py on the "
                                f"workdir once to build it again") from None
        self.layout = self.cache.layout(self.seed, self.seq_len)
        self._open: dict[int, np.ndarray | None] = {}

    def windows(self, step: int) -> list[tuple[int, int]]:
        """Step `step` (1 = the first)'s windows: (era, offset of its first token in the split)."""
        index = step - 1
        if self.config.data.order == "random":
            num_windows = self.layout.total_tokens - self.seq_len
            starts = batcher.random_starts(self.seed, index, num_windows, self.batch_size)
            return [(0, int(start)) for start in starts]
        _, era_of, offset_of = self.layout.locate(np.arange(index * self.batch_size, (index + 1) * self.batch_size))
        return [(int(era), self.layout.era_start(int(era)) + int(offset)) for era, offset in zip(era_of, offset_of)]

    def text(self, tokenizer, era: int, offset: int) -> str | None:
        if era not in self._open:
            self._open[era] = self.cache.verified(era)
        tokens = self._open[era]
        if tokens is None:  # deleted once training passed it (data.keep_eras)
            return None
        start = offset - self.layout.era_start(era)
        return tokenizer.decode(np.asarray(tokens[start:start + self.seq_len + 1]).tolist())[:_TEXT_CHARACTERS]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prints the windows each step of a run read.")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", required=True, help="A:B, steps A to B as the log numbers them, or A")
    parser.add_argument("--text", action="store_true", help="also the start of each window's text")
    parser.add_argument("--json", action="store_true", help="one JSON object a line")
    arguments = parser.parse_args(argv)
    with storage.WorkingCopy(arguments.workdir) as copy:  # of a gs:// workdir: its records, pulled
        run = RunWindows(copy.local)
        steps = step_range(arguments.steps)
        if steps.stop - 1 > int(run.config.steps):
            raise UserError(f"--steps {arguments.steps} goes past the run's last step, {run.config.steps}")
        tokenizer = tokenizers.load(os.path.join(copy.local, pipeline.TOKENIZER_FILE)) if arguments.text else None
        for step in steps:
            windows = run.windows(step)
            if arguments.json:
                line = {"step": step, "windows": [list(window) for window in windows]}
                if tokenizer is not None:
                    line["text"] = [run.text(tokenizer, *window) for window in windows]
                print(json.dumps(line))
                continue
            print(f"step {step}:")
            for row, (era, offset) in enumerate(windows):
                text = f"  {run.text(tokenizer, era, offset)!r}" if tokenizer is not None else ""
                print(f"  row {row}: era {era}, token {offset:,}{text}")


if __name__ == "__main__":
    try:
        main()
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
