"""A run's lifecycle (docs/lifecycle.md), explored through train.py as a user drives it.

A hypothesis state machine starts and resumes runs, kills them (kill -9), stops them (SIGTERM, Ctrl-C once or
twice, at a step or during start-up, also in a run started with Ctrl-C ignored), copies workdirs, resumes them
with allowed and refused changes, raises their stream budget, deletes eras and starts two runs at once, on a
tiny model over a streamed source cut in eras (tests/test_data_eras.py's `stream_run`). After every event it
checks that each step's loss equals an unbroken run's, that a run ends with rc 0 or 2 and in one line, never a
crash, that a refused run leaves its workdir as it was, and that no two runs hold one workdir.

CI runs a few fixed sequences; ANDREA_LIFECYCLE_SOAK=N runs N random ones of more events (the seed printed).
"""

import concurrent.futures
import contextlib
import fcntl
import glob
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, seed, settings, strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule,
                                 run_state_machine_as_test)

from andrea_jax import metrics
from tests.test_data_eras import stream_run
from tests.test_resume import checkpoint_steps, last_logged_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQ_LEN, ERA_WINDOWS = 4, 32, 12  # stream_run's: an era is 3 steps
# A run starts with the budget of S1 steps; a resume may raise it to S2's or S3's. The budgets' last eras are
# short, so a run raised S1 → S2 → S3 and one raised S1 → S3 cut their later eras at other places in the stream.
S1, S2, S3 = 8, 13, 20
FLAGS = ("--config.log_every=1", "--config.eval_every=1000", "--config.checkpoint_every=3",
         "--config.keep_checkpoints=2", "--config.data.keep_eras=0", "--config.optimizer.decay=constant",
         "--config.optimizer.warmup_steps=2")  # a constant rate after warmup: a step's loss does not depend on steps
ALLOWED = ("--config.checkpoint_every=2", "--config.checkpoint_every=5", "--config.keep_checkpoints=1",
           "--config.log_every=2", "--config.data.keep_eras=3")  # keep_eras=0 (FLAGS): every era stays, for a copy
REFUSED = {"seq_len": "--config.seq_len=16", "batch_size": "--config.batch_size=8", "seed": "--config.seed=1",
           "era_windows": "--config.data.era_windows=6"}
# The signals of each event, 0.2 s apart (SIGTERM then Ctrl-C: 0.05 s, inside the step or the stop's save).
EVENTS = {"end": (), "kill": ("SIGKILL",), "term": ("SIGTERM",), "int": ("SIGINT",), "int_int": ("SIGINT", "SIGINT"),
          "term_int": ("SIGTERM", "SIGINT")}
# When the event comes: once the run has logged k steps more ("step+k"), t seconds after launch ("2.5s": in
# start-up), or t seconds after the line that says the step compiles next ("compile+0.5s").
MOMENTS = st.one_of(st.integers(1, 12).map(lambda k: f"step+{k}"), st.integers(0, 10).map(lambda t: f"{t / 2}s"),
                    st.integers(0, 6).map(lambda t: f"compile+{t / 4}s"))
RUN = dict(fewer=st.booleans(), event=st.sampled_from(sorted(EVENTS)), at=MOMENTS,
           changes=st.lists(st.sampled_from(ALLOWED), max_size=2, unique=True), ignore_sigint=st.booleans())
RUN_TIMEOUT_S = 180
CRASHES = ("Traceback", "Fatal Python error", "Event loop is closed")

# Appended to stream_run's sitecustomize.py (SLOW_READS: its imports): with ANDREA_TEST_HOLD_BARRIER=DIR:N, each
# train.py process waits in run_dir.hold until N have come, so that two new runs take the lock together.
HOLD_BARRIER = '''

class HoldTogether(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "andrea_jax.run_dir" or not os.environ.get("ANDREA_TEST_HOLD_BARRIER"):
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            hold = module.hold

            def together(*args, **kwargs):
                directory, count = os.environ["ANDREA_TEST_HOLD_BARRIER"].rsplit(":", 1)
                open(os.path.join(directory, str(os.getpid())), "w").close()
                deadline = time.monotonic() + 60
                while len(os.listdir(directory)) < int(count) and time.monotonic() < deadline:
                    pass
                return hold(*args, **kwargs)

            module.hold = together

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, HoldTogether())
'''

COUNTS = {"sequences": 0, "events": 0, "train.py runs": 0}


def budget(steps: int) -> int:
    """data.stream_tokens for exactly the windows `steps` steps read in epoch 0."""
    full, rest = divmod(steps * BATCH, ERA_WINDOWS)
    return full * (ERA_WINDOWS * SEQ_LEN + 1) + (rest * SEQ_LEN + 1 if rest else 0)


class Run:
    """One train.py process on `workdir`, its output in a file read while it runs."""

    def __init__(self, world, workdir, steps, level, *flags, ignore_sigint=False, **env):
        descriptor, self.log = tempfile.mkstemp(suffix=".log", dir=world["logs"])
        command = [sys.executable, os.path.join(ROOT, "train.py"), "--config", str(world["config_file"]),
                   "--workdir", workdir, *FLAGS, f"--config.steps={steps}",
                   f"--config.data.stream_tokens={budget(level)}", *flags]
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command, stdout=descriptor, stderr=subprocess.STDOUT, env=dict(world["env"], **env), cwd=ROOT,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)
        os.close(descriptor)
        self.pid, self.workdir = self.process.pid, workdir
        COUNTS["train.py runs"] += 1

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def lines(self) -> list[str]:
        return [line.strip() for line in re.split(r"[\r\n]", self.output()) if line.strip()]

    def alive(self) -> bool:
        return self.process.poll() is None

    def finish(self, timeout=RUN_TIMEOUT_S) -> int:
        """Its exit code, waited for at most `timeout` seconds from now."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"train.py still ran after {timeout} s:\n{self.output()[-3000:]}") from None


def check_exit(run: Run, rc: int) -> None:
    """rc is never a signal's: each assert apart, so that each is a failure of its own."""
    output = run.output()[-3000:]
    assert rc != -signal.SIGTERM, f"SIGTERM killed train.py without a stop or a line:\n{output}"
    assert rc != -signal.SIGINT, f"Ctrl-C ended train.py by a KeyboardInterrupt it did not catch:\n{output}"
    assert rc >= 0, f"train.py crashed ({signal.Signals(-rc).name}):\n{output}"


def check_output(run: Run, rc: int) -> None:
    """rc 0 or 2, no traceback, and rc 2 in one line (the progress bar's last redraw may follow it)."""
    output = run.output()
    for crash in CRASHES:
        assert crash not in output, output[-3000:]
    assert rc in (0, 2), output[-3000:]
    if rc == 2:
        assert [line for line in run.lines() if not line.startswith("train:")][-1].startswith("error: "), \
            output[-3000:]


def check_no_crash(run: Run, rc: int) -> None:
    check_exit(run, rc)
    check_output(run, rc)


def wait_until(condition, run: Run, timeout=RUN_TIMEOUT_S) -> bool:
    """Polls until condition() (True) or the run's end (False)."""
    while not condition():
        if not run.alive() or time.monotonic() - run.started > timeout:
            return False
        time.sleep(0.01)
    return True


def lock_is_held(workdir: str) -> bool | None:
    """Whether a live process holds the workdir's run.lock (None where there is none): a fresh open, tried."""
    try:
        descriptor = os.open(os.path.join(workdir, "run.lock"), os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)  # lets go of the lock, had the probe taken it


def snapshot(workdir: str, leave_out=()) -> dict:
    """Every path under the workdir with its size, and the sha256 of the small files (run.lock: only there)."""
    found = {}
    for directory, _, files in os.walk(workdir):
        for name in files:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, workdir)
            if relative in leave_out:
                continue
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest() if size < 1 << 20 and name != "run.lock" else None
            found[relative] = (size if name != "run.lock" else None, digest)
    return found


def unbroken(world, name: str, levels: tuple) -> dict:
    """{step: loss} of a run trained to each of `levels` in turn, its budget raised with each, never stopped."""
    workdir = str(world["root"] / name)
    for level in levels:
        run = Run(world, workdir, level, level, f"--config.data.cache_dir={world['root'] / (name + '_cache')}")
        assert run.finish() == 0, run.output()[-3000:]
    return {r["step"]: r["loss"] for r in metrics.read(workdir) if "loss" in r}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """stream_run's config and environment, and the losses of the unbroken runs of both budget histories."""
    root = tmp_path_factory.mktemp("lifecycle")
    world = stream_run(root)
    with open(root / "slow" / "sitecustomize.py", "a") as f:
        f.write(HOLD_BARRIER)
    world.update(logs=root / "logs", sequences=root / "sequences")
    world["logs"].mkdir()
    world["sequences"].mkdir()
    histories = {(S1, S2, S3): "raised_twice", (S1, S3): "raised_once"}
    with concurrent.futures.ThreadPoolExecutor(2) as both:  # at once: 2 cores
        expected = dict(zip(histories, both.map(lambda h: unbroken(world, histories[h], h), histories)))
    twice, once = expected[(S1, S2, S3)], expected[(S1, S3)]
    assert sorted(twice) == list(range(1, S3 + 1)) and sorted(once) == sorted(twice)
    # The same steps up to S1; after it, other eras: a run that reads another's eras cannot log these losses.
    assert [once[s] for s in range(1, S1 + 1)] == [twice[s] for s in range(1, S1 + 1)]
    assert all(once[s] != twice[s] for s in range(S2 + 1, S3 + 1))
    world["expected"] = expected
    return world


class Lifecycle(RuleBasedStateMachine):
    """Workdirs (a bundle of their names) and the budgets each was raised through; the rest is read from disk."""

    workdirs = Bundle("workdirs")

    def __init__(self, world):
        super().__init__()
        self.world = world
        self.root = tempfile.mkdtemp(dir=world["sequences"])
        self.cache = os.path.join(self.root, "cache")  # the sequence's own: eras of one sequence only
        self.levels = {}  # workdir → the steps of each budget it trained under (S1, then its raises)
        self.flags, self.steps = {}, {}  # workdir → the allowed changes and the steps of its last run
        self.live = []
        COUNTS["sequences"] += 1

    def teardown(self):
        for run in self.live:
            with contextlib.suppress(OSError):
                os.kill(run.pid, signal.SIGCONT)
                run.process.kill()
            run.process.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- helpers ----

    def workdir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def exists(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.workdir(name), "config.json"))

    def level(self, name: str) -> int:
        if not os.path.exists(os.path.join(self.workdir(name), "eras.json")):
            self.levels[name] = (S1,)  # new, or removed by a stop before its first step: it starts again
        return self.levels[name][-1]

    def new_name(self) -> str:
        name = f"w{len(self.levels)}"
        self.levels[name], self.flags[name], self.steps[name] = (S1,), (), S1
        return name

    def launch(self, name: str, steps: int, *flags, level=None, **options) -> Run:
        run = Run(self.world, self.workdir(name), steps, level or self.level(name),
                  f"--config.data.cache_dir={self.cache}", *flags, **options)
        self.live.append(run)
        return run

    def check_ended(self, run: Run, rc: int, stops=(), in_training=False, new=False) -> None:
        """How a run ended, `stops` the stop signals that reached it (Ctrl-C left out where ignored)."""
        check_exit(run, rc)
        output, workdir = run.output(), run.workdir
        stopped = re.search(r"stopped at step (\d+)", output)
        if rc == 0 and stopped:
            assert int(stopped.group(1)) in checkpoint_steps(workdir), "the stop's checkpoint is missing"
        if not stops:
            assert rc == 0 and not stopped, output[-3000:]
        elif in_training and len(stops) == 1:
            # The first stop request in training finishes the step and saves it.
            assert rc == 0, f"one stop request ({stops[0]}) in training did not save and exit 0:\n{output[-3000:]}"
        elif rc == 2 and new and len(stops) == 1:
            assert not os.path.exists(workdir), "a stop before the first step left the workdir it created"
        check_output(run, rc)

    def check_refused(self, run: Run, rc: int, *words) -> None:
        lines = run.lines()
        assert rc == 2 and len(lines) == 1 and all(word in lines[0] for word in words), \
            f"rc {rc}, expected one line naming {words}:\n{run.output()[-3000:]}"

    # ---- events ----

    @initialize(target=workdirs, **RUN)
    def first_run(self, fewer, event, at, changes, ignore_sigint):
        name = self.new_name()
        self.run(name, fewer, event, at, changes, ignore_sigint)
        return name

    @rule(name=workdirs, **RUN)
    def run(self, name, fewer, event, at, changes, ignore_sigint):
        """Starts or resumes a run to its budget's steps (or 4 fewer) and sends `event` at the moment `at`."""
        COUNTS["events"] += 1
        workdir, level = self.workdir(name), self.level(name)
        new, before = not os.path.lexists(workdir), last_logged_step(workdir)
        steps = level - 4 if fewer else level
        run = self.launch(name, steps, *changes, ignore_sigint=ignore_sigint)
        self.flags[name], self.steps[name] = tuple(changes), steps
        signals, sent = EVENTS[event], False
        if signals and at.startswith("step+") and before < steps:
            target = min(before + int(at[len("step+"):]), steps)
            sent = wait_until(lambda: last_logged_step(workdir) >= target, run)
        elif signals and not at.startswith("step+"):
            compiling = at.startswith("compile+")
            sent = wait_until(lambda: not compiling or "\nmesh " in run.output(), run)
            since, seconds = time.monotonic() if compiling else run.started, float(at.split("+")[-1][:-1])
            sent = sent and wait_until(lambda: time.monotonic() - since >= seconds, run)
        for i, name_of_signal in enumerate(signals if sent else ()):
            time.sleep(0 if i == 0 else 0.05 if event == "term_int" else 0.2)
            if run.alive():
                run.process.send_signal(getattr(signal, name_of_signal))
        rc = run.finish()
        if sent and "SIGKILL" in signals:
            assert rc in (-signal.SIGKILL, 0), run.output()[-3000:]
            return
        stops = [s for s in signals if not (ignore_sigint and s == "SIGINT")] if sent else []
        self.check_ended(run, rc, stops, in_training=at.startswith("step"), new=new)
        if not stops:
            assert max(checkpoint_steps(workdir), default=0) >= steps, "the run did not train to its end"

    @rule(name=workdirs, to=st.sampled_from([S2, S3]))
    def raise_budget(self, name, to):
        """Resumes with data.stream_tokens raised to `to` steps' windows (and --config.steps to them): the eras go on
        in the stream where the budget ended."""
        COUNTS["events"] += 1
        level = self.level(name)
        if to <= level or not os.path.exists(os.path.join(self.workdir(name), "eras.json")):
            return
        run = self.launch(name, to, *self.flags[name], level=to)
        self.steps[name] = to
        self.check_ended(run, run.finish())
        self.levels[name] += (to,)

    @rule(target=workdirs, source=workdirs, go_on=st.sampled_from(["neither", "copy", "original"]),
          to=st.sampled_from([S2, S3]))
    def copy(self, source, go_on, to):
        """Copies a workdir while no run is live (a copy of none is a new workdir); one of them may go on at once,
        its budget raised to `to` steps'."""
        COUNTS["events"] += 1
        if len(self.levels) >= 4:
            return multiple()
        name = self.new_name()
        if os.path.exists(self.workdir(source)):
            shutil.copytree(self.workdir(source), self.workdir(name))
            for model in (self.levels, self.flags, self.steps):
                model[name] = model[source]
        if go_on != "neither":
            self.raise_budget(name if go_on == "copy" else source, to)
        return name

    @rule(name=workdirs, key=st.sampled_from(sorted(REFUSED)))
    def refused_resume(self, name, key):
        """A resume that changes what the run reads or computes exits 2 in one line naming the key, touching nothing."""
        COUNTS["events"] += 1
        if not self.exists(name):
            return
        workdir = self.workdir(name)
        before = snapshot(workdir)
        run = self.launch(name, self.level(name), REFUSED[key])
        rc = run.finish()
        check_no_crash(run, rc)
        self.check_refused(run, rc, "error: ", key)
        assert snapshot(workdir) == before, "a refused resume changed the workdir"

    @rule(name=workdirs)
    def start_a_finished_run(self, name):
        """The last command again on a run it finished trains nothing and rewrites nothing."""
        COUNTS["events"] += 1
        workdir, steps = self.workdir(name), self.steps[name]
        if not self.exists(name) or max(checkpoint_steps(workdir), default=0) < steps:
            return
        with open(os.path.join(workdir, "config.json"), "rb") as f:
            config = f.read()
        run = self.launch(name, steps, *self.flags[name])
        self.check_ended(run, run.finish())
        with open(os.path.join(workdir, "config.json"), "rb") as f:
            assert f.read() == config, "a start that trained no step rewrote config.json"

    @rule(name=workdirs)
    def second_start(self, name):
        """While a run holds the workdir (frozen there by SIGSTOP), a second start exits 2 naming it, touching nothing."""
        COUNTS["events"] += 1
        if not self.exists(name):
            return
        workdir = self.workdir(name)
        holder = self.launch(name, self.level(name), *self.flags[name])
        lock_file = os.path.join(workdir, "run.lock")
        holds = lambda: os.path.exists(lock_file) and f"pid {holder.pid} " in open(lock_file).read()
        if wait_until(holds, holder):
            holder.process.send_signal(signal.SIGSTOP)
            before = snapshot(workdir, leave_out=("eras.json",))  # the holder's encoder goes on
            second = self.launch(name, self.level(name), *self.flags[name])
            rc = second.finish()
            check_no_crash(second, rc)
            self.check_refused(second, rc, "is in use by a training run", str(holder.pid))
            assert snapshot(workdir, leave_out=("eras.json",)) == before, "a run refused at the lock changed the workdir"
            assert lock_is_held(workdir), "the holder's run.lock is gone or unlocked"
            holder.process.send_signal(signal.SIGCONT)
        self.check_ended(holder, holder.finish())

    @rule(target=workdirs)
    def two_starts_at_once(self):
        """Two starts on a new workdir that reach the lock together: one trains, the other exits 2 touching nothing."""
        COUNTS["events"] += 1
        if len(self.levels) >= 4:
            return multiple()
        name = self.new_name()
        barrier = tempfile.mkdtemp(dir=self.root)
        runs = [self.launch(name, S1, ANDREA_TEST_HOLD_BARRIER=f"{barrier}:2") for _ in range(2)]
        while all(run.alive() for run in runs) and time.monotonic() - runs[0].started < RUN_TIMEOUT_S:
            time.sleep(0.005)
        refused, holder = runs if not runs[0].alive() else runs[::-1]
        rc = refused.finish()
        if holder.alive():
            assert lock_is_held(self.workdir(name)), "the refused run removed or unlocked the holder's run.lock"
        check_no_crash(refused, rc)
        self.check_refused(refused, rc, "is in use by a training run", str(holder.pid))
        self.check_ended(holder, holder.finish())
        return name

    @rule()
    def delete_an_era(self):
        """The newest era on disk deleted (a tmp cleaner, a user freeing disk): a run that needs it encodes it again."""
        COUNTS["events"] += 1
        manifests = glob.glob(os.path.join(self.cache, "**", "train.era*.json"), recursive=True)
        if manifests:
            newest = max(manifests, key=os.path.getmtime)
            for path in (newest, newest[:-len("json")] + "bin"):  # the manifest first, as the trainer deletes one
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    # ---- after every event ----

    @invariant()
    def every_logged_loss_is_the_unbroken_runs(self):
        for name, levels in self.levels.items():
            expected = self.world["expected"][(S1, S3) if levels[:2] == (S1, S3) else (S1, S2, S3)]
            previous = 0
            for record in metrics.read(self.workdir(name)) if os.path.isdir(self.workdir(name)) else []:
                if "loss" not in record:
                    continue
                step, losses = record["step"], [expected[s] for s in range(previous + 1, record["step"] + 1)]
                previous = step
                mean = pytest.approx(sum(losses) / len(losses), rel=1e-5) if len(losses) > 1 else losses[0]
                assert record["loss"] == mean, f"{name} (budgets {levels}) logged another loss at step {step}"

    @invariant()
    def no_workdir_is_held_between_events(self):
        for name in self.levels:
            assert not lock_is_held(self.workdir(name)), f"{name}'s run.lock is held with no run live"


SOAK = int(os.environ.get("ANDREA_LIFECYCLE_SOAK", "0"))
SEED = random.randrange(2 ** 32)


def test_the_lifecycle_keeps_its_invariants(world):
    # CI: the same 3 sequences of up to 5 events every time; a soak: N random ones of 12, whose seed it prints.
    options = dict(max_examples=SOAK, stateful_step_count=12) if SOAK else dict(derandomize=True, max_examples=3,
                                                                               stateful_step_count=5)
    factory = lambda: Lifecycle(world)
    if SOAK:
        print(f"ANDREA_LIFECYCLE_SOAK={SOAK}: hypothesis seed {SEED}")
        factory = seed(SEED)(factory)
    run_state_machine_as_test(factory, settings=settings(deadline=None, database=None,
                                                         suppress_health_check=list(HealthCheck), **options))
    print(f"lifecycle: {COUNTS['sequences']} sequences, {COUNTS['events']} events, "
          f"{COUNTS['train.py runs']} train.py runs")
    assert COUNTS["sequences"] >= min(SOAK or 2, 2) and COUNTS["events"] > 0
