"""Built-in model-family plugins, one package per family."""
