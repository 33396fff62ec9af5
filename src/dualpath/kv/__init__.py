"""The KV machinery every shell shares: the block store (files or Mooncake Store), the node
buffers and their slots, the NIC pacers, the KV transports and the storage-node core
(``storage_node.py``: the reader and writer threads both shells run).

The runtime (``runtime/``) and the vLLM integration (``integrations/vllm/``) both build on it;
neither reaches into the other.
"""
