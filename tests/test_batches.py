"""python -m andrea_jax.tools.batches: the windows each step of a run read, from its workdir alone."""

import json
import subprocess
import sys

import numpy as np
import pytest

from andrea_jax import UserError
from andrea_jax.data import eras
from andrea_jax.tools import batches
from tests.test_data_eras import ROOT, encode_all, era_config, era_tokens_of, prepared_eras


def test_the_windows_printed_are_the_rows_the_steps_read(tmp_path, capsys):
    config, workdir = era_config(tmp_path), str(tmp_path / "run")
    prepared = prepared_eras(config, workdir)
    encode_all(config, prepared)
    capsys.readouterr()
    batches.main(["--workdir", workdir, "--steps", "3:5", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["step"] for line in lines] == [3, 4, 5]
    stream = np.concatenate(era_tokens_of(prepared.train))
    reader = eras.Reader(prepared.train, config.seed, config.seq_len, 0, False)
    for line in lines:
        rows = reader.batch(line["step"] - 1, config.batch_size)  # the log's step 3 is the loop's index 2
        assert len(line["windows"]) == config.batch_size
        for (era, offset), row in zip(line["windows"], rows):
            assert era == offset // prepared.train.era_tokens
            np.testing.assert_array_equal(stream[offset:offset + config.seq_len + 1], row)

    with pytest.raises(UserError, match=r"^--steps 9:11 goes past the run's last step, 10$"):
        batches.main(["--workdir", workdir, "--steps", "9:11"])
    batches.main(["--workdir", workdir, "--steps", "1", "--text"])
    out = capsys.readouterr().out.splitlines()
    era, offset = json.loads(json.dumps(batches.RunWindows(workdir).windows(1)[0]))
    text = prepared.tokenizer.decode(stream[offset:offset + 33].tolist())[:60]
    assert out[0] == "step 1:" and out[1] == f"  row 0: era {era}, token {offset:,}  {text!r}"


def test_bad_steps_and_a_workdir_without_a_run_are_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^--steps '5:2' is not A:B or A with 1 <= A <= B"):
        batches.step_range("5:2")
    assert batches.step_range("7") == range(7, 8)
    done = subprocess.run([sys.executable, "-m", "andrea_jax.tools.batches", "--workdir", str(tmp_path),
                           "--steps", "1:2"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"error: {tmp_path} holds no run that prepared its data (data.json is missing); pass the " \
                          f"--workdir train.py wrote\n"
