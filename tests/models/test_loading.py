"""Model configs read outside a composed config (``perplexity.model=<name>``)."""

from __future__ import annotations

import pytest

from pardec import CONF_DIR
from pardec.models.loading import named_config


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != "local"))
def test_every_named_model_config_resolves_on_its_own(name):
    """Their `dtype: ${oc.select:dtype,fp32}` resolved to itself when the YAML was loaded alone (an
    InterpolationResolutionError for `perplexity.model=<name>`); now against the run's dtype."""
    assert named_config(name).dtype == "fp32"
    assert named_config(name, "bf16").dtype == "bf16"


def test_an_unknown_name_is_one_line():
    with pytest.raises(FileNotFoundError, match="no model config .*nope.yaml"):
        named_config("nope")
