"""The Kubernetes HorizontalPodAutoscaler's replica calculation (autoscaling/v2), on a given clock.

What the HPA controller (pkg/controller/podautoscaler) does on each sync, for one metric of type
External with an ``AverageValue`` target (the kind deploy/k8s/ uses):

1. **raw**: usage ratio = metric / (target x current replicas); inside the tolerance (|1 - ratio| <= 0.1)
   the count stays, otherwise raw = ceil(metric / target) (= ceil(current x per-pod average / target));
2. **stabilization**: every raw recommendation is remembered with its time; scaling up goes only to
   the *lowest* recommendation within the scale-up window, scaling down only to the *highest* within
   the scale-down window;
3. **rate policies**: the change is capped by the behavior's policies (``Pods``: value pods per period;
   ``Percent``: value % of the replicas at the period's start), counting the scale events already made
   within each policy's period; ``selectPolicy: Max`` takes the policy allowing the largest change;
4. min/max replicas.

Defaults are Kubernetes' own: scale up without stabilization, at most max(4 pods, 100%) per 15 s;
scale down after a 300 s window, at most 100% per 15 s. Times are seconds on whatever clock the caller
uses (the autoscaling what-if uses the simulator's virtual clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

TOLERANCE = 0.1  # the controller's --horizontal-pod-autoscaler-tolerance default
SYNC_PERIOD_S = 15.0  # --horizontal-pod-autoscaler-sync-period default


@dataclass(frozen=True)
class Policy:
    type: Literal["Pods", "Percent"]
    value: int
    period_s: float


@dataclass(frozen=True)
class Rules:
    """One direction of an HPA ``behavior`` (scaleUp or scaleDown)."""

    window_s: float
    policies: tuple[Policy, ...]
    select: Literal["Max", "Min", "Disabled"] = "Max"


DEFAULT_UP = Rules(0.0, (Policy("Percent", 100, 15.0), Policy("Pods", 4, 15.0)))
DEFAULT_DOWN = Rules(300.0, (Policy("Percent", 100, 15.0),))
# The seed's HPA behavior ("Autoscaling Configuration"): 60 s of pressure before scaling up, at most
# 2 pods per 120 s; 300 s before scaling down (its scaleDown sets no policy: Kubernetes' default applies).
SEED_UP = Rules(60.0, (Policy("Pods", 2, 120.0),))
SEED_DOWN = Rules(300.0, DEFAULT_DOWN.policies)


@dataclass
class HPA:
    """One HPA on one AverageValue metric. ``sync(now, current, metric)`` returns the new replica count."""

    min_replicas: int
    max_replicas: int
    target: float  # AverageValue: the metric per replica the HPA aims at
    up: Rules = DEFAULT_UP
    down: Rules = DEFAULT_DOWN
    tolerance: float = TOLERANCE
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    up_events: list[tuple[float, int]] = field(default_factory=list)
    down_events: list[tuple[float, int]] = field(default_factory=list)

    def raw(self, current: int, metric: float) -> int:
        """Step 1: the replica count the metric alone asks for."""
        if current == 0:
            return max(1, math.ceil(metric / self.target))
        ratio = metric / (self.target * current)
        if abs(1.0 - ratio) <= self.tolerance:
            return current
        return math.ceil(metric / self.target)

    def sync(self, now: float, current: int, metric: float) -> int:
        desired = self.raw(current, metric)
        stabilized = self._stabilize(now, current, desired)
        new = self._rate_limit(now, current, stabilized)
        if new > current:
            self.up_events.append((now, new - current))
        elif new < current:
            self.down_events.append((now, current - new))
        return new

    def _stabilize(self, now: float, current: int, desired: int) -> int:
        up_rec = down_rec = desired
        for t, rec in self.recommendations:
            if t > now - self.up.window_s:
                up_rec = min(up_rec, rec)
            if t > now - self.down.window_s:
                down_rec = max(down_rec, rec)
        keep = max(self.up.window_s, self.down.window_s)
        self.recommendations = [(t, r) for t, r in self.recommendations if t > now - keep]
        self.recommendations.append((now, desired))
        rec = current
        if rec < up_rec:
            rec = up_rec
        if rec > down_rec:
            rec = down_rec
        return rec

    @staticmethod
    def _changed(events: list[tuple[float, int]], now: float, period_s: float) -> int:
        return sum(n for t, n in events if t > now - period_s)

    def _rate_limit(self, now: float, current: int, desired: int) -> int:
        if desired > current:
            limit = self._up_limit(now, current)
            return max(current, min(desired, limit, self.max_replicas))
        if desired < current:
            limit = self._down_limit(now, current)
            return min(current, max(desired, limit, self.min_replicas))
        return min(max(desired, self.min_replicas), self.max_replicas)

    def _up_limit(self, now: float, current: int) -> int:
        return self._limit(now, current, self.up, +1)

    def _down_limit(self, now: float, current: int) -> int:
        return self._limit(now, current, self.down, -1)

    def _limit(self, now: float, current: int, rules: Rules, sign: int) -> int:
        """The furthest count the policies allow in one direction (sign +1 up, -1 down), from the
        count at each policy period's start. ``Max`` picks the largest change, ``Min`` the smallest."""
        if rules.select == "Disabled" or not rules.policies:
            return current
        proposals = []
        for p in rules.policies:
            start = current - self._changed(self.up_events, now, p.period_s) + self._changed(self.down_events, now, p.period_s)
            if p.type == "Pods":
                proposals.append(start + sign * p.value)
            elif sign > 0:  # Percent, rounded so that a small fleet can still grow
                proposals.append(math.ceil(start * (1 + p.value / 100)))
            else:
                proposals.append(int(start * (1 - p.value / 100)))
        largest_change = max(proposals) if sign > 0 else min(proposals)
        smallest_change = min(proposals) if sign > 0 else max(proposals)
        return largest_change if rules.select == "Max" else smallest_change
