"""kvtier as a vLLM v1 KV connector (``kv_connector_module_path="kvtier.integrations.vllm"``).

Importing this package imports vLLM; the rest of kvtier never does. See ``connector``.
"""

from __future__ import annotations

from kvtier.integrations.vllm.connector import KvtierConnector, transfer_config

__all__ = ["KvtierConnector", "transfer_config"]
