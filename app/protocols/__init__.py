"""Other APIs' wire protocols spoken over Turnstile's runs: pure mappings, no HTTP, no SQL."""
