"""Parts every kernel family may use: Jinja includes of device code (`*.jinja`) and host helpers (`*.py`).
Every file here is part of every family's template hash."""
