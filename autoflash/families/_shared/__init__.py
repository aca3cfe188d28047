"""Parts every kernel family may use: Jinja includes of device code (`*.jinja`), device functions the
rendered kernel modules import (`triton_device.py`, through `device_modules`) and host helpers (`*.py`).
Every file here is part of every family's template hash."""
