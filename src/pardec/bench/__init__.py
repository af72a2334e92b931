"""Measuring this machine: ``python -m pardec.bench <subcommand>`` (``--help`` lists them).

* ``table`` (:mod:`pardec.bench.table`): every decoder on every benchmark, one run per benchmark, speed beside quality;
* ``speed`` (:mod:`pardec.bench.speed`): the speed tables (docs/cpu_speed.md), one ``python -m evaluate`` run per dataset;
* ``batch`` (:mod:`pardec.bench.batch`): throughput and latency of the batched methods against batched ``ar``, per batch size;
* ``cost`` (:mod:`pardec.bench.cost`): this machine's forward-cost table (what verification forwards pad by);
* ``gpu-smoke`` (:mod:`pardec.bench.gpu_smoke`): does pardec run, exactly, on this machine's GPU (``make gpu-smoke``);
* ``gpu-speed`` (:mod:`pardec.bench.gpu_speed`): per-step cost of the decoding loop at 1B / 7B shapes, random weights.
"""

COMMANDS = {
    "table": ("table", "every decoder on every benchmark with the zoo's drafters: one resumable run, one table"),
    "speed": ("speed", "the speed tables: methods side by side vs ar and transformers' decoders (make bench*)"),
    "batch": ("batch", "batched decoding: tokens/s and latency per batch size, the crossover below batched ar"),
    "cost": ("cost", "measure and save this machine's forward-cost table (ms of a cached forward of T rows)"),
    "gpu-smoke": ("gpu_smoke", "on a CUDA machine: every method exact in fp32/bf16, training steps (make gpu-smoke)"),
    "gpu-speed": ("gpu_speed", "per-step cost of the decoding loop at researchers' sizes, random weights, on a GPU"),
}
