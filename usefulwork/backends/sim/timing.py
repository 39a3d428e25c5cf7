"""How long one engine step takes on the simulated hardware: a roofline with calibrated efficiencies.

    memory  = weight bytes read / (tp x HBM bandwidth x hbm_efficiency)
              + KV bytes read by attention / (tp x HBM bandwidth x hbm_efficiency x kv_efficiency)
    compute = (2 x active params x tokens + attention FLOPs) / tp / (peak FLOP/s x mfu x precision speedup)
    step    = step_overhead + per_seq_overhead x sequences + max(memory, compute) + tensor-parallel all-reduces

where the catalog gives a GPU an ``overlap_p`` (fitted to a real card's timed steps), max(memory, compute)
becomes (memory^p + compute^p)^(1/p): the two overlap only in part when both are large.

A decode-only step is bandwidth-bound (every step streams all weights once); a step carrying a big
prefill chunk is compute-bound. Mixture-of-experts models read only the routed experts' weights
at small batch sizes and all of them once enough tokens are in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from usefulwork.backends.sim.catalog import SimSpec
from usefulwork.backends.sim.scheduler import StepPlan

# Tensor-parallel all-reduce: two per layer per step; latency-dominated at decode sizes.
ALLREDUCE_LATENCY_S = 8e-6
INTERCONNECT_BYTES_PER_S = 300e9  # NVLink-class per-direction bandwidth


def combine(memory: float, compute: float, p: float | None) -> float:
    """A step's memory and compute time together: ``max`` (full overlap) without ``p``, else
    (memory^p + compute^p)^(1/p), written from the larger one so that no power underflows."""
    hi = max(memory, compute)
    if p is None or hi <= 0.0:
        return hi
    return hi * (1.0 + (min(memory, compute) / hi) ** p) ** (1.0 / p)


@dataclass(frozen=True)
class StepCost:
    seconds: float
    memory_s: float
    compute_s: float
    overhead_s: float


class StepTimer:
    def __init__(self, spec: SimSpec):
        self.spec = spec
        m, g, p = spec.model, spec.gpu, spec.precision
        cal = g.calibration
        self._bw = g.hbm_gbps * 1e9 * cal.hbm_efficiency * spec.tp
        self._kv_bw = self._bw * cal.kv_efficiency
        self._flops = g.bf16_tflops * 1e12 * cal.mfu * p.compute_speedup * spec.tp
        self._weight_bytes = spec.weight_bytes
        if m.experts:
            expert_params = (m.total_params_b - m.active_params_b) * m.experts / (m.experts - m.experts_per_token)
            self._dense_bytes = (m.total_params_b - expert_params) * 1e9 * p.bytes_per_param
            self._expert_bytes = expert_params * 1e9 * p.bytes_per_param
            self._expert_share = m.experts_per_token / m.experts
        else:
            self._dense_bytes = self._weight_bytes
            self._expert_bytes = 0.0
            self._expert_share = 0.0
        self._kv_per_token = spec.kv_bytes_per_token
        self._flops_per_token = 2.0 * m.active_params_b * 1e9
        # QK^T and PV: 2 matmuls x 2 FLOPs x layers x (q heads x head dim) per (query, key) pair.
        self._attn_flops_per_pair = 4.0 * m.layers * m.q_heads * m.head_dim
        self._p = cal.overlap_p
        self._step_overhead = cal.step_overhead_ms / 1e3
        self._per_seq = cal.per_seq_overhead_ms / 1e3
        self._tp_per_token = 0.0
        self._tp_fixed = 0.0
        if spec.tp > 1:
            self._tp_fixed = 2 * m.layers * ALLREDUCE_LATENCY_S
            self._tp_per_token = 2 * m.layers * m.hidden * 2 * (spec.tp - 1) / spec.tp / INTERCONNECT_BYTES_PER_S

    def weight_bytes_read(self, tokens: int) -> float:
        if not self._expert_bytes:
            return self._dense_bytes
        touched = 1.0 - (1.0 - self._expert_share) ** tokens  # share of experts hit by >= 1 token
        return self._dense_bytes + self._expert_bytes * touched

    def cost(self, plan: StepPlan) -> StepCost:
        tokens = plan.total_tokens
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0)
        kv_read = 0
        attn_pairs = 0.0
        for it in plan.items:
            n, c = it.num_new_tokens, it.context_before
            kv_read += c + n
            attn_pairs += n * (c + (n + 1) / 2)
        memory = self.weight_bytes_read(tokens) / self._bw + kv_read * self._kv_per_token / self._kv_bw
        compute = (self._flops_per_token * tokens + self._attn_flops_per_pair * attn_pairs) / self._flops
        overhead = self._step_overhead + self._per_seq * len(plan.items) + self._tp_fixed + self._tp_per_token * tokens
        return StepCost(overhead + combine(memory, compute, self._p), memory, compute, overhead)

    def seconds(self, plan: StepPlan) -> float:
        return self.cost(plan).seconds
