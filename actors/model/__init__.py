"""OPT model code: configuration, batch layout, the transformer stage and weight loading."""
