"""A drafter's reduced vocabulary counted from its training corpus (EAGLE-3's draft vocabulary, and DFlash's when
``drafter.draft_vocab_size`` is set): :func:`corpus_vocab`, and :func:`check_vocab_size` before anything loads."""

from __future__ import annotations

import logging
from collections import Counter

from pardec.config import ConfigError
from pardec.models.preflight import read_config_json
from pardec.models.vocab import DraftVocab, choose_vocab

log = logging.getLogger(__name__)


def check_vocab_size(size: int, model) -> None:
    """``drafter.draft_vocab_size`` against the target's vocabulary when its config is at hand without loading it."""
    vocab = None if model.source == "tiny_random" else (read_config_json(model) or {}).get("vocab_size")
    if vocab is not None and size > vocab:
        raise ConfigError(f"drafter.draft_vocab_size={size} is out of range: it must be in [2, {vocab}] (the target "
                          f"{model.name}'s vocabulary)")


def corpus_vocab(size: int, records: list[dict], lm) -> tuple[DraftVocab, dict]:
    """``size`` ids from the completion tokens' counts (specials, pad and EOS always kept; EAGLE-3's reference
    cnets.py ``process_data`` l. 457-469 and ``scandata`` l. 666-674: the corpus's most common tokens, counted over
    the assistant tokens). Every rank reads the same merged records and counts them the same way (a Counter's totals
    do not depend on order, ``choose_vocab`` breaks ties by id), so all ranks build the same vocabulary without a
    broadcast. Returns (DraftVocab, facts: the size and the share of completion tokens it covers, the reference's
    "top N token frequency ratio")."""
    tok, target = lm.tokenizer, lm.model
    counts = Counter(t for r in records for t in r["completion_ids"])
    special = {*tok.all_special_ids, tok.pad_token_id, *lm.eos_ids}
    vocab_size = int(target.config.vocab_size)
    if size > vocab_size:
        raise ConfigError(f"drafter.draft_vocab_size={size} is out of range: it must be in [2, {vocab_size}] "
                          f"(the target's vocabulary)")
    ids = choose_vocab(counts, size, sorted(i for i in special if i is not None), vocab_size)
    kept = set(ids)
    total = sum(counts.values())
    covered = sum(c for t, c in counts.items() if t in kept) / max(1, total)
    log.info("draft vocabulary: top %d token frequency ratio %.2f%% (%d distinct of %d completion tokens)",
             size, 100 * covered, len(counts), total)
    return DraftVocab(ids, vocab_size), {"draft_vocab_size": size, "draft_vocab_coverage": covered,
                                         "corpus_distinct_tokens": len(counts), "corpus_completion_tokens": total}
