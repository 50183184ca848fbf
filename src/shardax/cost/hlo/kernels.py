"""The fused attention kernels of compiled HLO text: which kernel a step uses, and each
cuDNN attention call's shapes and FLOPs.

>>> line = ('%a = (bf16[2,128,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), '
...         'custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints='
...         '{bf16[2,128,4,64]{3,2,1,0}, bf16[2,256,4,64]{3,2,1,0}, bf16[2,256,4,64]{3,2,1,0}}')
>>> call = fused_attention(line)
>>> call.batch, call.seq_q, call.seq_kv, call.heads, call.head_dim, call.backward
(2, 128, 256, 4, 64, False)
>>> call.flops == 2 * 2.0 * 2 * 4 * 128 * 256 * 64
True
"""

from __future__ import annotations

import dataclasses
import re

# cuDNN's attention: the kind (Backward, ...) and the operands' shapes.
_FMHA = re.compile(
    r'custom_call_target="__cudnn\$fmha(\w*)".*?operand_layout_constraints=\{(.*?\})\}'
)
_DIMS = re.compile(r"\w+\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class FusedAttention:
    """One cuDNN fused attention call (``__cudnn$fmha*``, BTNH layout).

    Attributes:
        batch, seq_q, heads, head_dim: the queries' shape.
        seq_kv: the keys' sequence length.
        backward: a backward call (the gradients), else the forward.
        causal: a causal mask (the kernel skips the masked blocks).
    """

    batch: int
    seq_q: int
    heads: int
    head_dim: int
    seq_kv: int
    backward: bool
    causal: bool

    @property
    def flops(self) -> float:
        """Its matmul FLOPs: ``2·B·N·T·S·H`` per matmul, 2 forward (scores, weighted
        values) and 5 backward (the scores recomputed, then dV, dP, dQ, dK); halved for a
        causal mask."""
        matmuls = 5 if self.backward else 2
        causal = 0.5 if self.causal else 1.0
        b, t, n, h, s = self.batch, self.seq_q, self.heads, self.head_dim, self.seq_kv
        return 2.0 * b * n * t * s * h * matmuls * causal


def fused_attention(line: str) -> FusedAttention | None:
    """The cuDNN fused attention call of one instruction ``line``, else None (another
    instruction, or operands of another layout)."""
    found = _FMHA.search(line)
    if not found:
        return None
    shapes = [tuple(int(d) for d in m.split(",") if d) for m in _DIMS.findall(found.group(2))]
    if len(shapes) < 2 or len(shapes[0]) != 4 or len(shapes[1]) != 4:
        return None
    (b, t, n, h), s = shapes[0], shapes[1][1]
    return FusedAttention(b, t, n, h, s, "Backward" in found.group(1), "CAUSAL" in line.upper())


# HLO (custom_call_target="...") and StableHLO (stablehlo.custom_call @...) text
_CUSTOM_CALL = re.compile(
    r'^.*(?:custom_call_target="([^"]*)"|custom_call @([\w$.\-]+)).*$', re.MULTILINE
)


def attention_kernels(hlo: str) -> dict[str, int]:
    """How many fused attention kernel calls HLO text holds (compiled, or the lowered
    StableHLO: the kernel is chosen while tracing): ``"cudnn"``
    (cuDNN's ``__cudnn$fmha*`` custom calls, forward and backward) and ``"splash"``
    (Mosaic ``tpu_custom_call``s of Pallas' splash attention). Neither: attention, if
    any, is dense (``attention_kernel``).

    >>> attention_kernels('%c = bf16[2] custom-call(), custom_call_target="__cudnn$fmhaSoftmax"')
    {'cudnn': 1, 'splash': 0}
    """
    found = {"cudnn": 0, "splash": 0}
    for line in _CUSTOM_CALL.finditer(hlo):
        target = line.group(1) or line.group(2)
        if target.startswith("__cudnn$fmha"):
            found["cudnn"] += 1
        elif target == "tpu_custom_call" and "splash" in line.group(0):
            found["splash"] += 1
    return found


def attention_kernel(hlo: str) -> str:
    """The attention kernel compiled HLO text uses: ``"cudnn"``, ``"splash"`` or
    ``"dense"`` (no fused attention call).

    >>> attention_kernel("%d = f32[8,8]{1,0} dot(f32[8,4]{1,0} %a, f32[4,8]{1,0} %b)")
    'dense'
    """
    counts = attention_kernels(hlo)
    return max(counts, key=counts.__getitem__) if any(counts.values()) else "dense"
