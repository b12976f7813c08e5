"""What an engine tells a router about its load: the prefill work waiting, the sequences decoding, what a hit
still recomputes, how far before a prompt's branch point its branch checkpoint sits (the recompute tail), and the
measured cost of a step (`StepCost`), from which the router predicts a request's time
to first token on each replica (deployments/routing_policy.py)."""

from __future__ import annotations

import math

from app.dasc.policy import wr_window


class StepCost:
    """Step wall time as fixed_s + token_s x tokens, a least-squares fit over recent steps whose weights decay by
    `decay` per step (about 1 / (1 - decay) steps count). With too little spread in tokens per step to fit a slope,
    the whole time is taken as per-token cost. Steps of fewer than `min_tokens` tokens (decode steps) are left
    out: the fit predicts prefill, and a decode token, which attends over its whole context, costs several times a
    prefill token (measured: a replica that had mostly decoded fitted 1.1 ms a token against its peer's 0.18 ms,
    and the router stopped sending it prefill). A replica's first `warmup` prefill steps are left out too (the
    first pays for first-use allocations), and there is no fit before `min_steps` more (measured: a replica whose
    one prefill step was its first fitted 0.9 ms a token against its peer's 0.15 ms, and a hot prefix's 16
    concurrent requests all queued at the peer; without a fit the router prices a replica at its peers' cost)."""

    def __init__(self, decay: float = 0.98, min_tokens: int = 64, warmup: int = 1, min_steps: int = 4) -> None:
        self.decay, self.min_tokens, self.warmup, self.min_steps = decay, min_tokens, warmup, min_steps
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.seen = 0  # prefill steps seen, the warm-up ones included

    def add(self, tokens: int, seconds: float) -> None:
        if tokens < self.min_tokens:
            return
        self.seen += 1
        if self.seen <= self.warmup:
            return
        d = self.decay
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + tokens, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + tokens * tokens, d * self.sxy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed_s, token_s), both >= 0; None before `min_steps` steps beyond the warm-up."""
        if self.seen < self.warmup + self.min_steps or self.w <= 0 or self.sx <= 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var > 1e-6 * mx * mx + 1e-9:
            slope = (self.sxy / self.w - mx * my) / var
            if slope > 0 and my - slope * mx >= 0:
                return my - slope * mx, slope
            if slope > 0:  # a negative intercept: a line through the origin
                return 0.0, self.sxy / self.sxx
        return 0.0, my / mx


def load_report(engine) -> dict:
    """The engine's load as `record_routing_stats` publishes it (all plain numbers)."""
    sched, cfg = engine.scheduler, engine.cfg
    # a wr hit replays the omitted units over a window; an nr checkpoint is stored `tail` tokens early and loaded
    # only that far back, so its recompute is already in where it sits
    resume = (wr_window(engine.plan) if engine.plan is not None else math.ceil(cfg.w_max)) \
        if cfg.w_max is not None and cfg.policy == "wr" else 0
    prefill = sum(s.num_tokens - s.num_computed for s in sched.running if s.num_computed < s.num_tokens - 1)
    for s in sched.waiting:  # what each will prefill after resuming from the checkpoint it matches now
        limit = max(0, s.num_tokens - 1 - cfg.tail)
        hit = engine.cache.tree.match(s.tokens, limit, touch=False, salt=s.params.cache_salt)
        prefill += s.num_tokens - hit.checkpoint_len + (resume if hit.checkpoint_len else 0)
    decoding = sum(1 for s in sched.running if s.num_computed >= s.num_tokens - 1)
    fit = engine.telemetry.step_cost.fit()
    return {"prefill_tokens": int(prefill), "decoding": decoding, "resume_tokens": int(resume),
            "tail_tokens": cfg.tail, "prompt_ends": cfg.admission == "always",
            "lookback": cfg.lookback, "lookback_align": cfg.lookback_align,
            "step_tokens": cfg.max_tokens_per_step, "step_fixed_s": None if fit is None else fit[0],
            "step_token_s": None if fit is None else fit[1]}
