"""Memory comparisons that make the GPU scripts able to fail (benchmarks/gpu_check.sh).

Each check prints one ``CHECK <name>: ok|FAILED ...`` line with the measured value, the bound
and why the bound is what it is; a script exits non-zero when any check failed. The bounds are
reasoned, not calibrated: no GPU has run them yet (docs/runtime.md, "GPU rules").
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
# CUDA: what the allocator holds during a step besides what the simulator counts (weights,
# gradients and the saved activations): cuBLAS workspaces (a few MiB per handle and stream) and
# the caching allocator's rounding (to 512 B, 2 MiB small / 20 MiB large segments).
CUDA_FIXED_ALLOWANCE = 256 * MIB
# Reserved over allocated: caching-allocator fragmentation a plan can afford before an
# allocation fails and the allocator frees its cache (cudaFree: a device-wide synchronisation).
RESERVED_OVER_ALLOCATED = 1.25
RESERVED_SLACK = 512 * MIB
# The host pool keeps one segment of its need plus a margin (runtime/pool.py MARGIN 1/8); more
# than this over the need means it did not shrink or grew in a step.
POOL_OVER_NEED = 1.5
# Pinned memory torch's own host allocator may hold besides the pool (the first step's shape
# metadata rows): nothing of the offload goes through it.
TORCH_PINNED_SLACK = 1 * MIB


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"CHECK {self.name}: {'ok' if self.ok else 'FAILED'}: {self.detail}"


def peak_check(name: str, measured: float, predicted: float, allowance: float,
               why: str) -> Check:
    """``measured`` (the allocator's or the meter's peak, weights included) within
    ``allowance`` above ``predicted`` (the simulator's peak plus the weights), and not below
    ``predicted`` by more than the allowance either (a prediction far too high is wrong too)."""
    ok = predicted - allowance <= measured <= predicted + allowance
    return Check(name, ok, f"measured {measured / MIB:.2f} MiB, predicted {predicted / MIB:.2f} "
                           f"MiB +- {allowance / MIB:.2f} MiB ({why})")


def reserved_check(name: str, reserved: float, allocated: float) -> Check:
    bound = RESERVED_OVER_ALLOCATED * allocated + RESERVED_SLACK
    return Check(name, reserved <= bound,
                 f"reserved {reserved / MIB:.1f} MiB <= {RESERVED_OVER_ALLOCATED} x allocated "
                 f"{allocated / MIB:.1f} MiB + {RESERVED_SLACK / MIB:.0f} MiB (fragmentation a "
                 "plan can afford before the allocator's OOM path frees its cache)")


def host_pool_check(name: str, pool_bytes: float, need_bytes: float,
                    torch_pinned_bytes: float | None) -> Check:
    """The pool holds between its need and POOL_OVER_NEED times it; torch's pinned allocator
    (None: not measured, CPU) holds next to nothing."""
    ok = need_bytes <= pool_bytes <= POOL_OVER_NEED * need_bytes
    detail = (f"pool {pool_bytes / MIB:.2f} MiB for a need of {need_bytes / MIB:.2f} MiB "
              f"(<= {POOL_OVER_NEED} x)")
    if torch_pinned_bytes is not None:
        ok = ok and torch_pinned_bytes <= TORCH_PINNED_SLACK
        detail += (f"; torch's pinned allocator {torch_pinned_bytes / MIB:.2f} MiB <= "
                   f"{TORCH_PINNED_SLACK / MIB:.0f} MiB (the pool registers its own memory)")
    return Check(name, ok, detail)


def report(checks: list[Check]) -> bool:
    """Print every check; True when all passed."""
    for check in checks:
        print(check.line())
    return all(check.ok for check in checks)
