"""CPU linears in other number formats: int8 (:mod:`~pardec.models.quant.int8`: dynamic and weight-only schemes,
SmoothQuant) and oneDNN-prepacked bf16 (:mod:`~pardec.models.quant.packed`). Of models/ they import the host
fingerprint only."""
