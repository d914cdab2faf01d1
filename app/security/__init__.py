"""Authentication material: API keys, their scopes and their storage as SHA-256 hashes."""
