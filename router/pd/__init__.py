"""PD disaggregation in the router: `strategy` picks a prefill/decode pair and sends to both,
`prefill` speaks SGLang's wire format to the prefill side."""

from router.pd.strategy import PDSettings, PrefillDecode

__all__ = ["PDSettings", "PrefillDecode"]
