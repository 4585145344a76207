"""Fixtures for tests and benchmarks, not imported by runtime code: synthetic events (`fakes`), tiny random
Hugging Face models with locally built tokenizers (`hf_tiny`), the overrides of a tiny whole run (`runs`)."""
