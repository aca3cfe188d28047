"""The backward gate hands a candidate the O a training step hands it: in q's memory layout (a
(B, N, H, D) tensor seen through `.transpose(1, 2)` gives an O laid out the same way), so a kernel that
reads O with the wrong strides fails the gate instead of a user's training step."""

import pytest

from autoflash import codegen
from autoflash.device import gpu_fingerprint
from autoflash.problem import Shape
from autoflash.space import default_variant
from autoflash.tuning import gate


@pytest.mark.interpreter
def test_the_backward_gate_passes_o_in_qs_layout():
    shape = Shape(1, 2, 2, 37, 37, 64, True, "float16", op="bwd")
    kernel = codegen.load(default_variant("bwd", shape.problem, gpu_fingerprint()))
    seen = []

    class Spy:
        def __getattr__(self, name):
            return getattr(kernel, name)

        def backward(self, q, k, v, o, lse, do, *args, **kwargs):
            seen.append((q.stride(), o.stride()))
            return kernel.backward(q, k, v, o, lse, do, *args, **kwargs)

    assert gate.check(Spy(), shape, "cpu").passed
    assert seen and all(q == o for q, o in seen)
    assert any(q[1] < q[2] for q, _ in seen)  # (one of the gate's inputs is laid out (B, N, H, D))
