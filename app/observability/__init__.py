"""What operators see: Prometheus metrics and structured logs."""
