"""Every config key with its default, and the checks that run before any work.

Config files in `configs/` start from `base_config()` and change what they need;
`validate()` stops an impossible config with one line that names the fix.
"""

from __future__ import annotations

import math
import os

import ml_collections

from andrea_jax import UserError

# The ANDREA vocabulary: 256 byte tokens + 8192 BPE merges + end-of-text.
ANDREA_VOCAB_SIZE = 8449


class ConfigError(UserError):
    """A config that cannot run; the message names the fix."""


def base_config() -> ml_collections.ConfigDict:
    """Defaults shared by every config: the exact ANDREA-120M model."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 10_000
    c.batch_size = 32  # global, in sequences
    c.seq_len = 1024
    # Gradient accumulation inside the jitted step; 0 = the fewest micro-batches whose
    # compiled step fits the device's memory (`fit.py`), recorded in the run's config.
    c.microbatches = 0
    c.log_every = 10
    c.eval_every = 500
    c.eval_batches = 20  # validation batches per periodic evaluation
    c.checkpoint_every = 1000
    c.keep_checkpoints = 3
    # Peak FLOP/s of one device for MFU when it is not in the known table
    # (0 = the table's peak; CPUs have none in it, so no MFU is recorded for them).
    c.peak_flops = 0.0
    # A workdir whose newest checkpoint's parameters a new run starts from (its optimizer state and step start
    # anew): how a run continues with a change a resume refuses (run_dir.RESUMABLE); "" = a fresh init.
    c.init_params_from = ""
    # Per-block gradient norms, sub-layer delta ratios and stream norms among the
    # train step's metrics (keys "diag/..."); a few reductions a step.
    c.diagnostics = False
    # "A:B": a profiler trace of steps A to B (from 1) in the workdir's profile/ (trace.py); "" = none
    c.profile_steps = ""
    # Weights & Biases (optional: pip install wandb): every logged figure also goes to a W&B run of this
    # project ("" = off), continued on resume; a failure to reach it waits timeout_seconds at most.
    c.wandb = w = ml_collections.ConfigDict()
    w.project = ""
    w.entity = ""
    w.timeout_seconds = 60

    c.model = m = ml_collections.ConfigDict()
    m.n_layer = 12
    m.d_model = 768
    m.n_head = 12
    m.mlp_dim = 3072
    m.vocab_size = ANDREA_VOCAB_SIZE  # 0 = take the tokenizer's size
    m.vocab_pad_multiple = 1  # 1 = exact vocabulary; 128 gives fast matmul shapes
    m.max_len = 1024
    m.dtype = "float32"  # compute dtype: float32 | bfloat16 | float16 | auto; parameters are always float32
    m.dropout = 0.0
    m.layer_norm_epsilon = 1e-5
    m.attention = "xla"  # "xla" (einsum), "cudnn" (NVIDIA GPUs), "splash" (TPUs) or "auto" (attention.py)
    m.remat = False  # recompute each block in the backward pass
    m.scan_layers = False  # one compiled block scanned over depth
    # Ablations; the defaults are the ANDREA model (see model.py for the equations).
    m.norm_position = "pre"  # "pre": x + f(LN(x)); "post": LN(x + f(x))
    m.residual = True  # False: no skip connections
    m.activation = "gelu_tanh"  # "gelu_tanh", "gelu_exact", "relu" or "swiglu" (2/3 width, 3 matrices)
    m.mlp_ratio = 0.0  # 0 = the MLP width is mlp_dim; else mlp_ratio × d_model (mlp_dim is then unused)

    c.data = d = ml_collections.ConfigDict()
    # "tfds:NAME[/CONFIG]", "hf:OWNER/NAME[/CONFIG]", "text:PATH_OR_GLOB", "url:URL" (one text file) or "stdlib"
    d.source = "stdlib"
    d.tokenizer = "bpe"  # "bpe", "byte", "char" or a path to a tokenizer.json
    d.text_field = "text"  # TFDS feature or Hugging Face column holding the document text
    d.train_split = "train"
    d.val_split = "validation"  # used when the dataset has it
    d.val_fraction = 0.05  # held out by document when it has not
    d.tokenizer_train_bytes = 64_000_000  # bound on the BPE training sample
    # hf: sources are streamed: training tokens to take (0 = what the steps read: exactly their windows in
    # data.order="epochs", a tenth more in "random", whose windows are drawn with replacement), and the documents
    # held out for validation (of val_split if the dataset has it, else the
    # stream's first, which training skips).
    d.stream_tokens = 0
    d.stream_val_documents = 4000
    # hf: a hub dataset's revision (a commit hash, tag or branch), so that a later run reads the same
    # text; "" = the newest. Part of the token caches' key.
    d.hf_revision = ""
    # Which windows a step reads (`data/order.py`): "epochs" reads every window of the training split once an
    # epoch in a keyed order; "random" (runs started before it) draws each window at a random offset.
    d.order = "epochs"
    # A streamed training split is cached in eras of this many windows (at seq_len 1024, 64M tokens), built
    # by an encoder beside training; a finite source is one era. keep_eras: eras on disk at once (0 = all; more
    # when one step reads more).
    d.era_windows = 65536
    d.keep_eras = 4
    d.cache_dir = ""  # token caches and url: downloads; "" = ~/.cache/andrea_jax
    d.tfds_data_dir = ""  # "" = the TFDS default (~/tensorflow_datasets)

    # HellaSwag (`hellaswag.py`): completion-style accuracy, scored in the validation step's batch shape.
    c.hellaswag = h = ml_collections.ConfigDict()
    h.every = 0  # score it every N steps during training and at the end; 0 = never (eval.py --hellaswag: any run)
    h.source = "tfds:hellaswag"  # TFDS's validation split, or a path to the original JSONL (hellaswag_val.jsonl)
    h.examples = 0  # examples a score during training takes, evenly spaced, the same each time; 0 = all 10,042

    c.optimizer = o = ml_collections.ConfigDict()
    # "adamw", or "muon": Muon for the blocks' matrices, AdamW for the rest, at one rate (optimizer.py)
    o.name = "adamw"
    o.learning_rate = 6e-4
    o.warmup_steps = 500
    # "cosine", "linear" or "constant" after warmup; "wsd" holds the peak, then cools down over the last
    # cooldown_steps ("linear" or "1-sqrt"), so a resume with other steps moves the end while at the peak
    o.decay = "cosine"
    o.cooldown_steps = 0
    o.cooldown_shape = "linear"
    o.min_learning_rate_ratio = 0.1  # the floor, as a fraction of the peak
    o.weight_decay = 0.1
    # The tied embedding is both input table and output matrix; GPT-2 and
    # nanoGPT decay it like any matrix.
    o.decay_embedding = True
    o.b1 = 0.9
    o.b2 = 0.95
    o.eps = 1e-8
    o.grad_clip_norm = 1.0
    o.muon_momentum = 0.95  # Muon's Nesterov momentum
    o.muon_ns_steps = 5  # Newton–Schulz iterations orthogonalising each update
    # The iterations' dtype: "auto" = bfloat16 on GPUs and TPUs that compute in it (their matrix units' full
    # rate), float32 on CPUs and on a T4 (no bfloat16 tensor cores)
    o.muon_ns_dtype = "auto"

    # Mesh axis sizes; -1 takes the devices the other axes leave.
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    # Logical axis name -> mesh axes. Parameters use the plain names,
    # activations the `act_` names, so that fsdp shards weights, not activations.
    c.logical_axis_rules = [
        ("act_batch", ("data", "fsdp")), ("act_len", None), ("act_embed", None),
        ("act_heads", "tensor"), ("act_mlp", "tensor"), ("act_vocab", "tensor"),
        ("embed", "fsdp"), ("vocab", "tensor"), ("heads", "tensor"), ("mlp", "tensor"),
        ("qkv", None), ("head_dim", None), ("position", None), ("norm", None), ("layers", None),
    ]
    return c


def padded_vocab_size(model_config: ml_collections.ConfigDict) -> int:
    """The embedding rows: vocab_size rounded up to vocab_pad_multiple."""
    multiple = max(1, int(model_config.vocab_pad_multiple))
    return -(-int(model_config.vocab_size) // multiple) * multiple


def splash_takes_head_dim(width: int) -> bool:
    """Whether the TPU splash kernel (`attention.py`) takes heads this wide: it keeps a head's
    vector whole in the 128 lanes of a vector register, so up to 128 or a multiple of 128."""
    return width <= 128 or width % 128 == 0


def hellaswag_source_problem(source: str) -> str | None:
    """What is wrong with a HellaSwag source, naming the fix; None when it can be read."""
    if source.startswith("tfds:") and source != "tfds:hellaswag":
        return f"the TFDS HellaSwag source is 'tfds:hellaswag', not {source!r}; anything else is a path to a JSONL file"
    if not source.startswith("tfds:") and not os.path.isfile(source):
        return (f"HellaSwag file {source!r} does not exist; pass the path of HellaSwag's JSONL "
                f"(hellaswag_val.jsonl) or 'tfds:hellaswag'")
    return None


def profile_span(c: ml_collections.ConfigDict) -> tuple[int, int] | None:
    """The first and last step `profile_steps` traces, or None; an impossible span is a ConfigError."""
    text = str(c.profile_steps)
    if not text:
        return None
    first, _, last = text.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last) <= c.steps):
        raise ConfigError(f"profile_steps={text!r} must be 'A:B' with 1 <= A <= B <= steps={c.steps}, e.g. "
                          f"'{min(10, c.steps)}:{min(12, c.steps)}' (a few steps after the first compiles)")
    return int(first), int(last)


def _at_least(low: int, meaning: str = "") -> tuple:
    return (lambda value: value >= low), f"must be >= {low}" + (f" ({meaning})" if meaning else "")


def _finite(low: float, high: float, interval: str) -> tuple:
    """A finite number in [low, high], open at the ends `interval` writes with a parenthesis."""
    def allowed(value) -> bool:
        number = float(value)
        return (math.isfinite(number) and (number > low if interval[0] == "(" else number >= low)
                and (number < high if interval[-1] == ")" else number <= high))
    return allowed, f"must be a finite number in {interval}"


def _one_of(*choices: str) -> tuple:
    return (lambda value: value in choices), "is not one of " + ", ".join(map(repr, choices))


# (key, (whether a value is allowed, what the error says it must be)), checked in this order.
RULES = (
    *((key, _at_least(1)) for key in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "checkpoint_every",
                                       "keep_checkpoints", "model.n_layer", "model.d_model", "model.n_head",
                                       "model.mlp_dim", "model.max_len")),
    ("microbatches", _at_least(0, "0 = the fewest that fit the device")),
    ("model.vocab_size", _at_least(0, "0 = from the tokenizer")),
    ("model.vocab_pad_multiple", _at_least(1, "1 = no padding")),
    ("model.dtype", _one_of("auto", "float32", "bfloat16", "float16")),
    ("model.attention", _one_of("auto", "xla", "cudnn", "splash")),
    ("model.dropout", ((lambda value: 0.0 <= value < 1.0), "must be in [0, 1)")),
    ("model.norm_position", _one_of("pre", "post")),
    ("model.residual", ((lambda value: isinstance(value, bool)), "must be True or False")),
    ("model.activation", _one_of("gelu_tanh", "gelu_exact", "relu", "swiglu")),
    ("model.mlp_ratio", _at_least(0, "0 = use model.mlp_dim")),
    ("data.val_fraction", ((lambda value: 0.0 < value <= 0.5), "must be in (0, 0.5]")),
    ("data.stream_tokens", _at_least(0, "0 = what the steps read: exactly their windows in data.order='epochs', "
                                        "a tenth more in 'random'")),
    ("data.stream_val_documents", _at_least(1)),
    ("data.order", _one_of("epochs", "random")),
    ("data.era_windows", _at_least(1)),
    ("data.keep_eras", _at_least(0, "0 = keep every era")),
    ("hellaswag.every", _at_least(0, "0 = never")),
    ("hellaswag.examples", _at_least(0, "0 = all")),
    ("wandb.timeout_seconds", _at_least(1)),
    ("optimizer.name", _one_of("adamw", "muon")),
    ("optimizer.decay", _one_of("cosine", "linear", "constant", "wsd")),
    ("optimizer.cooldown_steps", _at_least(0)),
    ("optimizer.cooldown_shape", _one_of("linear", "1-sqrt")),
    ("optimizer.learning_rate", _finite(0, math.inf, "(0, inf)")),
    ("optimizer.min_learning_rate_ratio", _finite(0, 1, "[0, 1]")),
    ("optimizer.b1", _finite(0, 1, "[0, 1)")),
    ("optimizer.b2", _finite(0, 1, "[0, 1)")),
    ("optimizer.eps", _finite(0, math.inf, "(0, inf)")),
    ("optimizer.weight_decay", _finite(0, math.inf, "[0, inf)")),
    ("optimizer.muon_momentum", _finite(0, 1, "[0, 1)")),
    ("optimizer.muon_ns_steps", _at_least(1)),
    ("optimizer.muon_ns_dtype", _one_of("auto", "float32", "bfloat16")),
    ("optimizer.grad_clip_norm", ((lambda value: value > 0), "must be positive (a clip of 0 zeroes every gradient); "
                                                             "use a large value such as 1e9 to turn clipping off")),
    ("optimizer.warmup_steps", _at_least(0)),
    *((f"mesh.{axis}", ((lambda size: size == -1 or size > 0), "must be a positive size or -1 (the remaining devices)"))
      for axis in ("data", "fsdp", "tensor")),
)


def validate(c: ml_collections.ConfigDict) -> None:
    """Checks that need no devices; the mesh and the micro-batch split are checked by `sharding.make_mesh`."""
    for key, (allowed, requirement) in RULES:
        value = c[key]
        if not allowed(value):
            raise ConfigError(f"{key}={value!r} {requirement}")
    m = c.model
    if m.d_model % m.n_head:
        raise ConfigError(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}; "
                          f"pick a divisor such as {max(h for h in range(1, 65) if m.d_model % h == 0)}")
    if m.attention == "splash" and not splash_takes_head_dim(m.d_model // m.n_head):
        raise ConfigError(f"model.attention='splash' takes heads up to 128 wide or a multiple of 128, not "
                          f"{m.d_model // m.n_head} (d_model / n_head); change n_head or use 'auto'")
    width = m.mlp_ratio * m.d_model
    if m.mlp_ratio > 0 and (width < 1 or abs(width - round(width)) > 1e-6):
        raise ConfigError(f"model.mlp_ratio={m.mlp_ratio} × model.d_model={m.d_model} = {width:g} is not a whole "
                          f"number of units; pick a ratio that gives one, or set mlp_ratio=0 and model.mlp_dim")
    if c.seq_len > m.max_len:
        raise ConfigError(f"seq_len={c.seq_len} exceeds model.max_len={m.max_len}; "
                          f"lower seq_len or raise model.max_len")
    if c.hellaswag.every and (problem := hellaswag_source_problem(str(c.hellaswag.source))):
        raise ConfigError(f"hellaswag.source: {problem}; or hellaswag.every=0 (no HellaSwag in training)")
    profile_span(c)
    o = c.optimizer
    if o.decay == "wsd" and not 1 <= o.cooldown_steps <= c.steps - min(o.warmup_steps, c.steps):
        raise ConfigError(f"optimizer.cooldown_steps={o.cooldown_steps} must be from 1 to the "
                          f"{c.steps - min(o.warmup_steps, c.steps)} steps after warmup with decay='wsd'; "
                          f"about a fifth of the steps ({max(1, c.steps // 5)}) is usual")
    if sum(int(c.mesh[a]) == -1 for a in ("data", "fsdp", "tensor")) > 1:
        raise ConfigError("only one of mesh.data, mesh.fsdp, mesh.tensor may be -1")
