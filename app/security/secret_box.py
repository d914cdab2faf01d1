"""Secrets at rest: webhook signing secrets encrypted under a key derived from
`TURNSTILE_SECRET_KEY`, so a dump of the database alone does not reveal them.

The setting (at least 32 characters) goes through HKDF-SHA256 to a 256-bit AES-GCM key; each
value gets a fresh 96-bit nonce, stored in front of its ciphertext. The HKDF `info` names the
purpose, so the same setting could key other secrets later without sharing a key.
"""

from __future__ import annotations

import base64
import os
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MIN_KEY_CHARS = 32
NONCE_BYTES = 12
SECRET_BYTES = 24  # 192 bits, within Standard Webhooks' 24 to 64 bytes
SECRET_PREFIX = "whsec_"  # noqa: S105 (the format's prefix, not a secret)


class SecretKeyMissingError(RuntimeError):
    """TURNSTILE_SECRET_KEY is unset or too short: no secret can be stored or read."""


class SecretUnreadableError(RuntimeError):
    """A stored secret does not decrypt under the current key (the key changed)."""


class SecretBox:
    def __init__(self, setting: str | None) -> None:
        if not setting or len(setting) < MIN_KEY_CHARS:
            raise SecretKeyMissingError(
                f"TURNSTILE_SECRET_KEY must be set to at least {MIN_KEY_CHARS} characters to "
                "store webhook secrets"
            )
        key = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"turnstile webhook secrets"
        ).derive(setting.encode())
        self._aead = AESGCM(key)

    def encrypt(self, plain: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plain, None)

    def decrypt(self, stored: bytes) -> bytes:
        try:
            return self._aead.decrypt(stored[:NONCE_BYTES], stored[NONCE_BYTES:], None)
        except InvalidTag:
            raise SecretUnreadableError(
                "the webhook secret does not decrypt: was TURNSTILE_SECRET_KEY changed?"
            ) from None


def new_signing_secret() -> tuple[str, bytes]:
    """A fresh Standard Webhooks secret: its shown form (`whsec_` + base64) and its raw bytes."""
    raw = secrets.token_bytes(SECRET_BYTES)
    return SECRET_PREFIX + base64.b64encode(raw).decode(), raw
