"""A profiler trace of chosen steps (`config.profile_steps="A:B"`): where a step's time goes on the chip.

`jax.profiler` writes the trace under `<workdir>/profile/process_<N>/plugins/profile/<time>/`, one directory
per process (each traces its own devices): `<host>.xplane.pb` for TensorBoard's profile plugin and XProf, and
`<host>.trace.json.gz` for Perfetto. The traced steps are ordinary steps; the trace waits for the last one
to finish before it stops, and the host's wait changes no number.

A stop inside the span (Ctrl-C, SIGTERM, an error) ends the trace with the run, which says which steps it
holds; the resumed run traces the span's remaining steps into a `<time>/` directory of its own.
"""

from __future__ import annotations

import os

import jax
import ml_collections
from tqdm import tqdm

from andrea_jax.config import profile_span

TRACE_DIR = "profile"


def _say(line: str) -> None:
    if jax.process_index() == 0:
        tqdm.write(line)


class StepTrace:
    """Starts the trace before step A runs, or before the first step of a run resumed inside A..B, and stops
    it once step B is done (steps counted from 1)."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict, start_step: int = 0) -> None:
        self.span = profile_span(config)
        self.directory = os.path.join(workdir, TRACE_DIR, f"process_{jax.process_index()}")
        self.tracing = False
        # The span's steps this run trains: those before start_step were traced, or not, by an earlier run.
        self.first = None if self.span is None or start_step >= self.span[1] else max(self.span[0], start_step + 1)
        self.last_done = start_step

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.directory)
            self.tracing = True

    def after(self, step: int, state) -> None:
        self.last_done = step
        if self.tracing and step == self.span[1]:
            jax.block_until_ready(state)
            self.close()
            earlier = "" if self.first == self.span[0] else (
                f"; steps {self.span[0]} to {self.first - 1} ran before the resume, their trace in a directory of "
                f"its own")
            _say(f"traced steps {self.first} to {self.span[1]} into {self.directory}{earlier} (README, \"Watching "
                 f"a run\", says how to read it)")

    def close(self) -> None:
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()
            if self.last_done < self.span[1]:  # the run stops inside the span
                held = f"steps {self.first} to {self.last_done}" if self.last_done >= self.first else "no whole step"
                _say(f"the trace of steps {self.span[0]} to {self.span[1]} stopped with the run after step "
                     f"{self.last_done}: {self.directory} holds {held}; a resume traces the steps after its "
                     f"checkpoint up to {self.span[1]}")
