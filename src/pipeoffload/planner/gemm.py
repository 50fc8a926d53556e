"""Matmul efficiency by shape: how much slower than a large GEMM a narrow one runs.

A preset's ``bf16_flops_per_s`` is the rate of a whole layer whose matmuls are large (the
PipeOffload authors' figure for unsharded layers). A GEMM of shape (m, n, k) reaches a fraction
of it that depends on its arithmetic intensity, 2 m n k FLOPs over the e (m k + k n + m n) bytes
it must at least read and write (NVIDIA, "Matrix Multiplication Background User's Guide",
section 2: a GEMM is memory-bound below the GPU's ops:byte ratio, math-bound above it). The
intensity is the same for a linear layer's forward Y = X W, its input gradient dY W^T and its
weight gradient X^T dY (the three dimensions only trade places), so one fraction prices all
three passes of a matmul.

Note [GEMM efficiency curve]: the fraction is read from points (intensity in FLOP/byte,
fraction of the large-GEMM rate), interpolated linearly in log-intensity, proportional to the
intensity below the first point (memory-bound: time = bytes / bandwidth) and flat above the
last. ``pipeoffload probe`` measures the points on the local GPU (``Hardware.gemm_points``);
without them, ``roofline_points`` draws the default curve from the GPU's ops:byte ratio
(``Hardware.gemm_ridge_flops_per_byte``). The default is an assumption: the guide's roofline
(time = the longer of math time and memory time) with the corner rounded, because a kernel
overlaps its loads with its math imperfectly near the ridge; docs/planner-model.md says what it
leaves out (tile and wave quantization, which only a probe sees).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeoffload.errors import ConfigError
from pipeoffload.planner.transformer import MlpKind, TransformerSpec

#: The reference GEMM whose rate counts as "large": the probe's 8192^3 bf16 product.
REFERENCE_SIZE = 8192
#: How sharply the default curve turns from the memory roof to the math roof: the achieved
#: time is the p-norm of (math time, memory time); p = 1 adds them (no overlap), p -> inf is the
#: guide's max (perfect overlap). 2 is our assumption in between.
ROOF_SHARPNESS = 2.0
#: Intensities (FLOP/byte) at which ``roofline_points`` samples the default curve (it adds the
#: reference GEMM's, where the curve reaches 1).
CURVE_INTENSITIES = (8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0)


@dataclass(frozen=True)
class Gemm:
    """An (m x k) @ (k x n) product with ``bytes_per_element``-byte inputs and output, or
    ``batch`` of them run as one batched kernel."""

    m: float
    n: float
    k: float
    bytes_per_element: int = 2
    batch: float = 1

    @property
    def flops(self) -> float:
        return 2 * self.m * self.n * self.k * self.batch

    def input_gradient(self) -> Gemm:
        """dX = dY W^T of the linear layer Y = X W this GEMM is: (m x n) @ (n x k)."""
        return Gemm(self.m, self.k, self.n, self.bytes_per_element, self.batch)

    def weight_gradient(self) -> Gemm:
        """dW = X^T dY: (k x m) @ (m x n)."""
        return Gemm(self.k, self.n, self.m, self.bytes_per_element, self.batch)

    @property
    def intensity(self) -> float:
        """FLOPs per byte of the least traffic the product needs (read A and B, write C)."""
        traffic = self.m * self.k + self.k * self.n + self.m * self.n
        return 2 * self.m * self.n * self.k / (self.bytes_per_element * traffic)


#: The output tile one thread block computes in a large 16-bit GEMM [assumption: the 256 x 128
#: tile of the examples in NVIDIA's "Matrix Multiplication Background User's Guide", section 3;
#: cuBLAS picks among several].
TILE = (256, 128)


def wave_efficiency(gemm: Gemm, sm_count: int) -> float:
    """Useful work over the work of the waves a GEMM takes: its output is cut into tiles, one
    per thread block, a partial tile costing a whole one (the guide's "tile quantization",
    section 3.1), and the GPU runs ``sm_count`` blocks at once, so 1.1 waves of tiles take as
    long as 2 ("wave quantization", section 3.2). The better of the tile's two orientations;
    1 without an SM count."""
    if sm_count < 1:
        return 1.0
    best = 0.0
    for tile_m, tile_n in (TILE, TILE[::-1]):
        useful = gemm.m * gemm.n / (tile_m * tile_n) * gemm.batch
        tiles = math.ceil(gemm.m / tile_m) * math.ceil(gemm.n / tile_n) * math.ceil(gemm.batch)
        best = max(best, useful / (math.ceil(tiles / sm_count) * sm_count))
    return best


def reference_intensity(bytes_per_element: int = 2) -> float:
    """Intensity of the reference square GEMM (8192 / 3 FLOP/byte in 16-bit)."""
    size = REFERENCE_SIZE
    return Gemm(size, size, size, bytes_per_element).intensity


def _roof(intensity: float, ridge: float) -> float:
    """Achieved fraction of the math rate at ``intensity`` (see ROOF_SHARPNESS)."""
    p = ROOF_SHARPNESS
    return (1.0 + (ridge / intensity) ** p) ** (-1.0 / p)


@functools.lru_cache(maxsize=16)  # a pure function of one number, asked per matmul priced
def roofline_points(ridge_flops_per_byte: float) -> tuple[tuple[float, float], ...]:
    """The default curve for a GPU whose math rate over memory bandwidth is
    ``ridge_flops_per_byte``, as fractions of the reference GEMM's rate (capped at 1)."""
    if ridge_flops_per_byte <= 0:
        raise ConfigError(
            f"gemm_ridge_flops_per_byte must be positive, got {ridge_flops_per_byte!r}"
        )
    reference = _roof(reference_intensity(), ridge_flops_per_byte)
    return tuple(
        (intensity, min(1.0, _roof(intensity, ridge_flops_per_byte) / reference))
        for intensity in (*CURVE_INTENSITIES, reference_intensity())
    )


def check_points(points: Sequence[Sequence[float]], where: str) -> None:
    """Raise ConfigError unless ``points`` are (intensity > 0, 0 < fraction <= 1) pairs in
    strictly increasing intensity."""
    for point in points:
        if len(point) != 2 or not all(isinstance(x, (int, float)) and x > 0 for x in point) \
                or point[1] > 1:
            raise ConfigError(
                f"{where}: each GEMM point must be [intensity FLOP/byte > 0, fraction in "
                f"(0, 1]], got {list(point)!r}"
            )
    intensities = [point[0] for point in points]
    if any(b <= a for a, b in zip(intensities, intensities[1:])):
        raise ConfigError(f"{where}: GEMM points must be sorted by increasing intensity")


def curve_fraction(points: tuple[tuple[float, float], ...], intensity: float) -> float:
    """The fraction of the large-GEMM rate at ``intensity`` (Note [GEMM efficiency curve])."""
    if not points:
        return 1.0
    first_i, first_f = points[0]
    if intensity <= first_i:
        return first_f * intensity / first_i
    for (lo_i, lo_f), (hi_i, hi_f) in zip(points, points[1:]):
        if intensity <= hi_i:
            t = math.log(intensity / lo_i) / math.log(hi_i / lo_i)
            return lo_f + t * (hi_f - lo_f)
    return points[-1][1]


@dataclass(frozen=True)
class LayerGemms:
    """The linear layers of one transformer layer on one of ``tp`` GPUs, forward shapes with
    m = b s tokens (sequence parallelism all-gathers the full sequence before each matmul):
    QKV and the first MLP matmul(s) are column-parallel (n / tp), the output projection and the
    last MLP matmul row-parallel (k / tp)."""

    qkv: Gemm
    proj: Gemm
    mlp_in: Gemm
    mlp_out: Gemm

    def all(self) -> tuple[Gemm, ...]:
        return (self.qkv, self.proj, self.mlp_in, self.mlp_out)


def layer_gemms(spec: TransformerSpec, micro_batch: int, tp: int) -> LayerGemms:
    """Forward GEMM shapes of a layer's linear layers (SwiGLU's gate and up as one n = 2f
    product, as fused kernels run them)."""
    tokens, h, e = micro_batch * spec.seq_len, spec.hidden, spec.activation_bytes
    width = 2 * spec.ffn_hidden if spec.mlp is MlpKind.SWIGLU else spec.ffn_hidden
    return LayerGemms(
        qkv=Gemm(tokens, (h + 2 * spec.kv_hidden) / tp, h, e),
        proj=Gemm(tokens, h, h / tp, e),
        mlp_in=Gemm(tokens, width / tp, h, e),
        mlp_out=Gemm(tokens, h, spec.ffn_hidden / tp, e),
    )


def head_gemm(spec: TransformerSpec, micro_batch: int, tp: int) -> Gemm:
    """The vocabulary-parallel output projection."""
    return Gemm(micro_batch * spec.seq_len, spec.vocab / tp, spec.hidden, spec.activation_bytes)
