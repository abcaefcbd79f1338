"""ANDREA-120M on 5B tokens of FineWeb-Edu with Muon and a warmup-stable-decay schedule: the recipe for GPT-2
124M's HellaSwag (acc_norm 0.2955) in fewer tokens than llm.c's (configs/andrea120m_fineweb10b.py, kept for
comparison). Why each setting, and what it is expected to take on each chip: README, "The recipes",
and bench/RESULTS.md's optimizer study. Estimates, not yet a result: it has not been run on an accelerator."""

from configs import andrea120m_fineweb10b


def get_config():
    c = andrea120m_fineweb10b.get_config()  # the model, data, batch (524,288 tokens a step) and evaluation
    c.steps = 9_537  # × 524,288 = 5.0B tokens: where AdamW at 3× with WSD reached GPT-2's loss (modded-nanogpt)
    o = c.optimizer
    o.name = "muon"  # the best arm of the CPU study, on every seed (bench/RESULTS.md)
    # 6× llm.c's peak: at configs/tiny.py 2× the earlier 1.8e-3 (3× llm.c's, as build-nanogpt's 3× run) ended
    # 0.022 lower on seeds 1-2 (3.914 ± 0.007 against 3.935 ± 0.002; 4× was worse on seed 0), the rule set before
    # the runs (bench/RESULTS.md, the floor study). Muon's update is scaled to AdamW's RMS (optimizer.py), so its
    # step is 0.2 × 3.6e-3 = 7.2e-4 an element: Keller Jordan's default Muon step (0.02 × 1/sqrt(768)).
    o.learning_rate = 3.6e-3
    o.warmup_steps = 300  # build-nanogpt's 3× run warmed up over ~285
    o.decay = "wsd"  # ends well at any step: resume with steps = the checkpoint's + cooldown_steps to end early
    o.cooldown_steps = 1_907  # the last 20% (Hägele et al.: 10-20%)
    o.cooldown_shape = "1-sqrt"  # better than linear in Hägele et al.
    # To a tenth of the peak (min_learning_rate_ratio, the default): cooling to zero instead gained nothing at
    # shakespeare_char (1.615 against 1.613, seeds 1-2; bench/RESULTS.md, the floor study)
    c.data.stream_tokens = 5_100_000_000  # the first 5.1B tokens of the sample: the 5.0B the steps read, each once
    return c
