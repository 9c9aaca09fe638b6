"""The paper's experiments (Figures 1, 8, 11, 14, 15), one module each; run with
``python -m fastserve.bench.experiments NAME [--sim] [--quick]``. ``common`` holds the shared machinery."""
