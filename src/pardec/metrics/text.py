"""Text-overlap metrics: ROUGE (summarisation) and sacreBLEU (translation)."""

from __future__ import annotations

from functools import cache

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")


@cache
def _rouge_scorer():
    from rouge_score import rouge_scorer  # heavy: rouge_score

    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


def rouge(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F1 in [0, 1] of one prediction against one reference (Porter stemming on)."""
    scores = _rouge_scorer().score(reference, prediction)  # rouge_score's order: (target, prediction)
    return {k: scores[k].fmeasure for k in ROUGE_KEYS}


def bleu(predictions: list[str], references: list[str]) -> float:
    """Corpus sacreBLEU (default 13a tokenisation) of predictions against one reference each, 0-100."""
    import sacrebleu  # heavy: sacrebleu

    if len(predictions) != len(references):
        raise ValueError(f"bleu: {len(predictions)} predictions but {len(references)} references")
    return sacrebleu.corpus_bleu(predictions, [references]).score


def sentence_bleu(prediction: str, reference: str) -> float:
    """sacreBLEU of one sentence (smoothed; a per-document diagnostic, not the corpus score), 0-100."""
    import sacrebleu  # heavy: sacrebleu

    return sacrebleu.sentence_bleu(prediction, [reference]).score
