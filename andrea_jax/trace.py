"""A profiler trace of chosen steps (`config.profile_steps="A:B"`): where a step's time goes on the chip.

`jax.profiler` writes the trace under `<workdir>/profile/process_<N>/plugins/profile/<time>/`, one directory
per process (each traces its own devices): `<host>.xplane.pb` for TensorBoard's profile plugin and XProf, and
`<host>.trace.json.gz` for Perfetto. The traced steps are ordinary steps; the trace waits for the last one
to finish before it stops, and the host's wait changes no number.
"""

from __future__ import annotations

import os

import jax
import ml_collections
from tqdm import tqdm

from andrea_jax.config import profile_span

TRACE_DIR = "profile"


class StepTrace:
    """Starts the trace before step A runs and stops it once step B is done (steps counted from 1)."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict) -> None:
        self.span = profile_span(config)
        self.directory = os.path.join(workdir, TRACE_DIR, f"process_{jax.process_index()}")
        self.tracing = False

    def before(self, step: int) -> None:
        if self.span is not None and step == self.span[0]:
            jax.profiler.start_trace(self.directory)
            self.tracing = True

    def after(self, step: int, state) -> None:
        if self.tracing and step == self.span[1]:
            jax.block_until_ready(state)
            self.close()
            if jax.process_index() == 0:
                tqdm.write(f"traced steps {self.span[0]} to {self.span[1]} into {self.directory} (README, "
                           f"\"Watching a run\", says how to read it)")

    def close(self) -> None:
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()
