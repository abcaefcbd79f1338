"""Dump the compiled programs a change must leave alone, and compare two dumps.

    python bench/compare_programs.py dump DIR [cpu|gpu|tpu|CHIP_RUN ...]   # default: cpu
    python bench/compare_programs.py compare DIR_A DIR_B

Each program's optimized HLO goes to DIR/NAME.hlo without its metadata={...} and source tables
(`compile.program_text`), which name Python files and lines: a refactor that moves code changes those
and nothing else. A chip's train step also gets DIR/NAME.hbm.json, its memory traffic by part of the
model (`hbm_traffic`, which reads the metadata before it goes). The gpu group needs JAX's CUDA plugin
(requirements-gpu-compile.txt, JAX_PLATFORMS=cpu), the tpu group libtpu; a full-size program compiles
in 1 to 3 minutes on 2 cores, and a chip's run (`FULL_SIZE`, `SMALL_CHIP_STEPS`) can be named alone.
`compare` exits 1 when a file differs or is on one side only, naming each.
"""

from __future__ import annotations

import difflib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The chips' rows of the compile check: andrea120m as typed, with the micro-batches its fit chooses (the T4
# takes 2), and small steps through the paths the full-size ones leave out (XLA's attention on chips that
# have a kernel, query blocks on a GPU, dropout).
FULL_SIZE = {"t4": 2, "l4": 1, "a100_40gb": 1, "h100": 1, "v5e-1": 1, "v6e-1": 1}
SMALL = {"model.n_layer": 1, "model.d_model": 128, "model.n_head": 2, "model.vocab_size": 256, "seq_len": 512,
         "batch_size": 2, "microbatches": 1}
SMALL_CHIP_STEPS = {
    "a100_40gb-small-xla-bf16": ("a100_40gb", {"model.attention": "xla", "model.dtype": "bfloat16"}),
    "a100_40gb-small-auto-f32": ("a100_40gb", {"model.attention": "auto", "model.dtype": "float32"}),
    "a100_40gb-small-dropout": ("a100_40gb", {"model.attention": "auto", "model.dtype": "bfloat16",
                                              "model.dropout": 0.1}),
    "t4-small-xla-f16": ("t4", {"model.attention": "auto", "model.dtype": "auto"}),
    "v5e-1-small-xla": ("v5e-1", {"model.attention": "xla", "model.dtype": "bfloat16"}),
    "v5e-1-small-dropout": ("v5e-1", {"model.attention": "auto", "model.dtype": "bfloat16", "model.dropout": 0.1}),
    "v6e-1-small-splash": ("v6e-1", {"model.attention": "auto", "model.dtype": "bfloat16"}),
    "a100_40gb-small-heads192": ("a100_40gb", {"model.d_model": 768, "model.n_head": 4, "model.attention": "auto",
                                               "model.dtype": "bfloat16"}),
}
CHIP_RUNS = set(FULL_SIZE) | set(SMALL_CHIP_STEPS)
CPU_VARIANTS = {
    "f32": {"model.dtype": "float32"},
    "bf16": {"model.dtype": "bfloat16"},
    "dropout": {"model.dtype": "bfloat16", "model.dropout": 0.1},
    "remat": {"model.dtype": "bfloat16", "model.remat": True},
    "scan": {"model.dtype": "bfloat16", "model.scan_layers": True},
    "scan-remat-f32": {"model.dtype": "float32", "model.scan_layers": True, "model.remat": True},
}


def _cpu_config(name: str, overrides: dict):
    from configs import shakespeare_char, tiny
    config = {"tiny": tiny, "shakespeare": shakespeare_char}[name].get_config()
    if name == "shakespeare":
        config.model.vocab_size = 65  # the text's characters and end-of-text
    config.update_from_flattened_dict({"microbatches": 1, **overrides})
    return config


def cpu_programs():
    """(name, compiled) of the CPU steps: each config and variant's train and eval step, tiny's at a length
    that takes attention's query blocks, the decoding programs and the logit lens's head."""
    import flax.linen as nn
    import jax
    import ml_collections
    from andrea_jax import model
    from andrea_jax.compile import check, targets
    from andrea_jax.tools import sampling

    target = targets.Target("cpu", jax.devices()[:1], 2 ** 40, "host", 1)
    runs = {f"cpu-{name}-{variant}": (name, overrides) for name in ("tiny", "shakespeare")
            for variant, overrides in CPU_VARIANTS.items()}
    runs["cpu-tiny-bf16-len256"] = ("tiny", {"model.dtype": "bfloat16", "seq_len": 256, "batch_size": 4})
    for name, (config_name, overrides) in runs.items():
        steps = check.compiled_for(_cpu_config(config_name, overrides), target, report=lambda line: None)
        yield f"{name}-train", steps.train
        yield f"{name}-eval", steps.eval
    for dtype in ("float32", "bfloat16"):
        m = ml_collections.FrozenConfigDict(_cpu_config("tiny", {"model.dtype": dtype}).model)
        params = nn.meta.unbox(jax.eval_shape(lambda: model.init_params(m, jax.random.key(0))))
        cache = jax.eval_shape(lambda: sampling.init_cache(m, 1))
        for length in (7, 1):
            ids = jax.ShapeDtypeStruct((1, length), jax.numpy.int32)
            yield f"cpu-decode-{dtype}-len{length}", sampling.prefill.lower(params, cache, ids, m).compile()
        stream = jax.ShapeDtypeStruct((2, 16, m.d_model), jax.numpy.float32)
        head = jax.jit(lambda p, x, m=m: model.head(p, m, x))
        yield f"cpu-head-{dtype}", head.lower(params, stream).compile()


def chip_programs(platform: str, only: set[str] | None = None):
    """(name, compiled) of andrea120m as typed and the small steps on each chip of `platform` (those `only` names)."""
    from andrea_jax.compile import check, targets
    from configs import andrea120m

    gpus = set(targets.gpu_names())
    on_platform = lambda chip: (chip in gpus) == (platform == "gpu")
    runs = {chip: (chip, {"microbatches": micro}) for chip, micro in FULL_SIZE.items()}
    runs.update({name: (chip, {**SMALL, **overrides}) for name, (chip, overrides) in SMALL_CHIP_STEPS.items()})
    for name, (chip, overrides) in runs.items():
        if not on_platform(chip) or (only and name not in only):
            continue
        config = andrea120m.get_config()
        config.update_from_flattened_dict(overrides)
        steps = check.compiled_for(config, targets.named(chip), report=lambda line: None)
        yield f"{name}-train", steps.train
        yield f"{name}-eval", steps.eval


def dump(directory: pathlib.Path, selection: list[str]) -> None:
    from andrea_jax.compile import hbm_traffic
    from andrea_jax.compile.program_text import without_source_info

    directory.mkdir(parents=True, exist_ok=True)
    groups = {"cpu": cpu_programs, "gpu": lambda: chip_programs("gpu"), "tpu": lambda: chip_programs("tpu")}
    runs = set(selection) - set(groups)
    if runs:  # chips' runs by name
        groups.update(named=lambda: (*chip_programs("gpu", runs), *chip_programs("tpu", runs)))
        selection = [group for group in selection if group not in runs] + ["named"]
    for group in selection:
        for name, compiled in groups[group]():
            text = compiled.as_text()
            (directory / f"{name}.hlo").write_text(without_source_info(text))
            if group != "cpu" and name.endswith("-train"):
                traffic = hbm_traffic.count(text)
                (directory / f"{name[:-len('-train')]}.hbm.json").write_text(json.dumps(traffic, indent=1) + "\n")
            print(f"{name}: {len(text)} characters", flush=True)


def compare(left: pathlib.Path, right: pathlib.Path) -> int:
    names = sorted({p.name for p in left.iterdir()} | {p.name for p in right.iterdir()})
    differing = 0
    for name in names:
        a, b = left / name, right / name
        if not (a.exists() and b.exists()):
            print(f"{name}: only in {a.parent if a.exists() else b.parent}")
            differing += 1
        elif (text_a := a.read_text()) != (text_b := b.read_text()):
            diff = list(difflib.unified_diff(text_a.splitlines(), text_b.splitlines(), str(a), str(b), n=1,
                                             lineterm=""))
            print(f"{name}: DIFFERS ({len(diff)} diff lines)\n" + "\n".join(diff[:40]))
            differing += 1
        else:
            print(f"{name}: identical")
    print(f"{len(names) - differing} of {len(names)} files identical")
    return 1 if differing else 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "dump" and set(argv[2:]) <= {"cpu", "gpu", "tpu"} | CHIP_RUNS:
        dump(pathlib.Path(argv[1]), argv[2:] or ["cpu"])
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return compare(pathlib.Path(argv[1]), pathlib.Path(argv[2]))
    print("usage:\n" + "\n".join(__doc__.strip().splitlines()[2:4]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
