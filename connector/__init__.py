"""Engine-side glue: SGLang adapters and the SGLang-compatible CPU worker (issue: connector)."""
