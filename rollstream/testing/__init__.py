"""Fixtures for tests and benchmarks, not imported by runtime code: synthetic events (`fakes`) and tiny
random Hugging Face models with locally built tokenizers (`hf_tiny`)."""
