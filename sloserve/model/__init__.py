"""Model side: loading (GGUF, Hugging Face, dummy), layers, attention backends, sampler, runner."""
