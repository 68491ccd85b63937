"""kvtier: a tiered KV-cache store for LLM inference."""

from kvtier import _native

# before anything imports the compiled modules: loads their sources if the build is stale or
# KVTIER_PURE is set (kvtier/_native.py)
_native.install()
