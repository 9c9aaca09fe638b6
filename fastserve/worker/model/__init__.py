"""Model code of the data plane: OPT and LLaMA-family configs (one interface, picked by
``model_type``), batch layout, shared paged attention, the transformer stages and weight loading."""
