"""Data plane: stage workers, the KV store, OPT model code, weight loading and sampling.

Importing this package must not import torch: ``fastserve.worker.messages`` (the data plane's contract) is
imported by control-plane policy modules that stay torch-free. Submodules import torch themselves.
"""
