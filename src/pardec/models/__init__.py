"""Model loading, the cached-model seam and draft models. Importing this package registers the draft model
class (``pardec_draft``) with transformers' Auto classes."""

from pardec.models import draft as _draft  # noqa: F401  (registers DraftConfig / DraftForCausalLM)
