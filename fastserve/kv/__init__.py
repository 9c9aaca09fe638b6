"""Control-plane KV-cache management (paper §4.2): block tables, the two tiers, the prefix cache,
ENST and swap planning. Pure Python: the data plane (``fastserve/worker/kv_store.py``) copies."""
