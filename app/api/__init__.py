"""The HTTP layer: thin routes over the queue core and the runtime."""
