"""Control-plane KV-cache management (paper §4.2): block tables, the two tiers and the prefix
cache (``manager``, ``prefix``, ``tables``), ENST (``enst``) and swap planning
(``swap_planner``). Pure Python: the data plane (``fastserve/worker/kv_store.py``) copies what
these modules decide.
"""
