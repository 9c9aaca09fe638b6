"""Data plane: stage workers, the KV store, model code, weight loading and sampling. Importing it
must not import torch: torch-free control-plane modules import ``fastserve.worker.messages``."""
