"""Control-plane KV-cache management (paper §4.2): block tables and free lists of the device and
host tiers (``manager``), ENST (``enst``) and swap planning (``swap_planner``). Pure Python: the
data plane (``fastserve/worker/kv_store.py``) copies what these modules decide.
"""
