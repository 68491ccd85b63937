"""kvtier: a tiered KV-cache store for LLM inference."""
