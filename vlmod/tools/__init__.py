"""What users run on a model: convert, ARank, FLOPs, the KV cache, pre-LLM reduction."""
