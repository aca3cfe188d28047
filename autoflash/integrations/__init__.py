"""Integrations with model libraries (imported on demand; autoflash does not depend on them)."""
