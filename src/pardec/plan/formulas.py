"""The plan's formulas: activations (Korthikanti et al. 2022, a gated MLP), the measured loss peaks, ZeRO."""

from __future__ import annotations

import json

from pardec import CONF_DIR
from pardec.config import ConfigError
from pardec.plan.shapes import Arch


# ------------------------------------------------------------------------------------------- formulas
def layer_activations(tokens: int, seq: int, a: Arch, act_bytes: int, eager: bool) -> float:
    """One transformer layer's saved activations (Korthikanti et al. 2022, eq. 2: ``s b h (34 + 5 a s / h)`` bytes at
    16-bit), ``tokens`` = b x s; the ``5 a s^2 b`` score term only under eager attention. The 34 is attention 11 +
    two norms 4 + a 4h GELU MLP 19 (its input 2, GELU input and output 8 + 8, dropout mask 1); a gated MLP of width
    i keeps its input 2h, the gate's output, SiLU's output, the up projection's output and their product (the
    down projection's input) 4 x 2i, and no dropout mask: 17h + 8i in all (Llama-2-7B 1.13x the 34h, Llama-3.1-8B
    1.32x)."""
    per_token = (17 * a.hidden + 8 * a.intermediate if a.gated else 34 * a.hidden) + (5 * a.heads * seq if eager else 0)
    return tokens * per_token * act_bytes / 2


#: the peak of a loss's forward + backward over its logits, beyond the logits themselves, in fp32 copies of those
#: logits: measured with pardec.metrics.memory at [2, 256, 8192] on the CPU, the same for fp32 and bf16 logits (the
#: fp32 log-softmax, its gradient and the logits' gradient: 3; the smoothed CE's mean term one more; the KL the
#: teacher's log-softmax and its exponent two more). A training step's after the first: the first call of a process
#: also holds one-time buffers (up to 1.5 copies more). tests/test_plan.py re-measures every entry with the real code
LOSS_PEAK = {
    "ce": 3.0,            # pardec.training.losses.ar_loss (a hard-label CE)
    "ce_smoothed": 4.0,   # ar_loss with label smoothing (CLLM's AR term, epsilon 0.1)
    "ce_sum": 3.0,        # ce_sum over selected positions (SDSAT Eq. 9)
    "kl": 5.0,            # token_divergence, KL to a teacher's logits (CLLM consistency, draft, Medusa / FIRP)
    "soft_ce": 3.0,       # EAGLE-3's CE to the target's probabilities per TTT step (training/drafter/eagle.soft_ce)
    "dflash": 3.0,        # DFlash's slot log-softmax, gather and argmax (training/drafter/dflash.slot_nll)
}


def loss_logits(rows: int, vocab: int, loss: str, logit_bytes: int) -> float:
    """Bytes of ``rows`` positions' logits over ``vocab`` in ``logit_bytes`` and their loss's peak
    (:data:`LOSS_PEAK`)."""
    return rows * vocab * (logit_bytes + 4 * LOSS_PEAK[loss])


def depth_logits(k: int, rows: int, vocab: int, run_bytes: int, base_copies: float) -> float:
    """The logits of heads trained at ``k`` depths against the base's row (Medusa, FIRP): the base's logits in the
    run's dtype, and in fp32 per depth the student's row, its log-softmax and gradient, and the logits' gradient
    (3 copies each, kept for the backward of the sum over depths), plus ``base_copies`` of one depth that each type
    holds once (the teacher's log-softmax and probabilities of the depth being computed, the type's own rows):
    measured per type at K = 2, ``tests/test_plan_measured.py``."""
    return rows * vocab * (run_bytes + 4 * (3 * k + base_copies))


def stack_activations(n_layers: int, tokens: int, seq: int, a: Arch, act_bytes: int, eager: bool,
                      checkpointing: bool) -> float:
    if n_layers <= 0:
        return 0.0
    full = layer_activations(tokens, seq, a, act_bytes, eager)
    if checkpointing:  # each layer keeps its input; one layer is recomputed at a time
        return n_layers * tokens * a.hidden * act_bytes + full
    return n_layers * full


def _zero_stage(deepspeed: str | None) -> int:
    if not deepspeed:
        return 0
    path = CONF_DIR / "deepspeed" / f"{deepspeed}.json"
    if not path.is_file():
        raise ConfigError(f"trainer.deepspeed={deepspeed!r}: no {path}")
    return int(json.loads(path.read_text())["zero_optimization"]["stage"])


def _max_live() -> float:
    z3 = json.loads((CONF_DIR / "deepspeed" / "zero3.json").read_text())["zero_optimization"]
    return float(z3.get("stage3_max_live_parameters", 1e9))
