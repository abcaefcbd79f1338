"""bench/compare_programs.py's comparison of two dumps: equal files pass, a changed or missing one is named."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compare(left, right):
    return subprocess.run([sys.executable, "bench/compare_programs.py", "compare", str(left), str(right)],
                          capture_output=True, text=True, cwd=ROOT)


def test_two_dumps_compare_equal_only_when_every_file_is_the_same_on_both_sides(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    for side in (before, after):
        side.mkdir()
        (side / "cpu-tiny-f32-train.hlo").write_text("HloModule jit_step\n\nENTRY %main {\n  ROOT %x = f32[] add()\n}\n")
        (side / "t4.hbm.json").write_text('{"attention": 1.0}\n')
    same = compare(before, after)
    assert same.returncode == 0 and same.stdout.splitlines()[-1] == "2 of 2 files identical"

    (after / "t4.hbm.json").write_text('{"attention": 2.0}\n')
    (after / "v5e-1-train.hlo").write_text("HloModule jit_step\n")
    changed = compare(before, after)
    assert changed.returncode == 1 and changed.stdout.splitlines()[-1] == "1 of 3 files identical"
    assert 't4.hbm.json: DIFFERS' in changed.stdout and '+{"attention": 2.0}' in changed.stdout
    assert f"v5e-1-train.hlo: only in {after}" in changed.stdout
