"""Speculative decoding: drafts, the depth each sequence drafts to, and the acceptance of a verified piece.

A decoding sequence with k drafts feeds its last token and the drafts as one piece of 1 + k tokens. Row j of the
piece's logits is the model's next-token distribution after the last token and the first j drafts, so one
forward scores every draft:

    piece:   x0    d1    d2    d3          (x0: the last sampled token, not computed yet)
    row:     0     1     2     3           row j predicts the token after d_j
    greedy:  accept d1 if argmax(row 0) == d1, then d2 against row 1, ...; at the first mismatch emit the
             row's own argmax instead; after k accepted drafts emit row k's pick (the bonus token)

Sampled rows use rejection sampling against the deterministic draft, coupled to plain decoding: row j draws the
token y_j that plain decoding would sample there (`sample_rows`, one uniform from the request's generator), and
d_j is kept when y_j == d_j; otherwise y_j is emitted and the piece ends. So d_j is kept with probability p_j(d_j)
(the target's sampling distribution at that row, after temperature, min_p, top-k and top-p) and a rejection
emits a token from p_j with d_j removed: standard rejection sampling for a draft that puts all its mass on one
token, whose emitted tokens follow the target's distribution exactly. The coupling adds that the generator
advances once per emitted token, as in plain decoding, so a seeded request emits plain decoding's tokens
whatever was drafted (up to logits differing in the last bits between a verify piece and a decode step). Every row
is processed as plain decoding would process it at that position (penalties, logit_bias, min_tokens, grammar),
with the earlier accepted drafts counted as output.

The state after the piece covers all 1 + k tokens; `Worker.rollback` brings it back to the tokens that stay.

Depth. Each sequence keeps an estimate of the chance that its next draft token is accepted (an exponential
average over its own verify steps, never the batch's). A verify step costs more than a decode step whatever its
drafts (c0 decode steps: `spec_verify_cost`, the verify path's fixed work) and more with each draft (c:
`spec_draft_cost`). With acceptance a, k drafts yield (1 - a^(k+1)) / (1 - a) tokens for 1 + c0 + c k steps; the
depth is the k that maximises that ratio if it beats plain decoding's 1, up to `spec_tokens`. When it is 0 the
sequence decodes plainly and probes again with one draft after PROBE_AFTER steps, a wait that doubles after every
verify that accepted nothing (up to PROBE_MAX) and resets when a draft is accepted. A new sequence probes at its
first chance. A probe needs a match of the longest n-gram (`spec_ngram_max`): in a batch every verify step makes
the whole step pay the verify path's fixed cost, so probes wait for strong evidence. A seeded request's output does
not depend on the depth anyway (see the acceptance above).

Batches. In a step that decodes B sequences plain decoding yields B tokens per step; a verify step yields B plus
the drafting rows' expected extra tokens X for 1 + c0 + c K steps (K drafts in all), so drafts pay only when
X > B (c0 + c K): a row's drafts buy its own tokens, but the verify path's fixed cost slows all B rows. `select`
keeps a step's drafts by that rule (at B = 1 it keeps what the depth chose). A probe rides along when the step
verifies anyway; alone it makes the whole step a verify step, so it waits sqrt(B) times the sequence's own wait
before it may; a row whose drafts the rule drops is verified anyway after the same wait, so that its estimate is
tested again. This reads the batch size, which the
issue's wording excludes from depth decisions; what it protects (a seeded request's output not depending on what
runs beside it) holds because of the coupled acceptance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from app.engine.config import EngineConfig
from app.engine.logits import needs_processing, process
from app.engine.sampling import sample_rows

ALPHA_START = 0.3  # the acceptance estimate before a sequence's first verify step: depth 0, so it starts by a probe
ALPHA_WEIGHT = 0.3  # weight of the newest verify step in the estimate
PROBE_AFTER = 16  # plain decode steps before a sequence whose drafts did not pay tries one draft again
PROBE_MAX = 256  # ... doubled after each verify that accepted nothing, up to this


@dataclass
class SpecState:
    """One sequence's speculative state: its n-gram index and its acceptance history."""

    index: dict = field(default_factory=dict)  # (n, n-gram) -> end of its latest occurrence with a follower
    indexed: int = 0  # tokens[:indexed] are in the index
    alpha: float = ALPHA_START
    idle: int = 1 << 30  # plain steps since the depth fell to 0 (a new sequence probes at its first chance)
    wait: int = PROBE_AFTER  # plain steps before the next probe


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (the longest n in [ngram_min, ngram_max] that occurred), with no extra model. An index per sequence maps each
    n-gram to where it last ended, updated as tokens arrive, so a lookup costs O(ngram_max) whatever the length."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.max_tokens, self.fixed, self.cost = cfg.spec_tokens, cfg.spec_verify_cost, cfg.spec_draft_cost
        self.ns = range(cfg.spec_ngram_max, cfg.spec_ngram_min - 1, -1)

    def depth(self, st: SpecState) -> int:
        """The number of drafts that maximises expected tokens per unit of step cost (see the module doc)."""
        a = min(st.alpha, 0.999)
        best, best_k = 1.0, 0
        for k in range(1, self.max_tokens + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / (1 + self.fixed + self.cost * k)
            if gain > best + 1e-9:
                best, best_k = gain, k
        return best_k

    def propose(self, seq, limit: int) -> tuple[int, ...]:
        """Up to `limit` drafts for `seq` (fewer where the depth or the match is shorter; () for none). A probe
        (one draft at depth 0, once the sequence's wait is over) needs a match of the longest n-gram: the
        strongest evidence that copying resumed."""
        st = seq.spec
        if st is None:
            st = seq.spec = SpecState()
        k = min(self.depth(st), limit)
        ns = self.ns
        if k <= 0:
            st.idle += 1
            if st.idle < st.wait or limit <= 0:
                return ()
            k, ns = 1, self.ns[:1]
        self._index(st, seq)
        n_tok = seq.num_tokens
        for n in ns:
            if n_tok <= n:
                continue
            key = (n, tuple(seq.token_range(n_tok - n, n_tok)))
            end = st.index.get(key)
            if end is not None:
                return tuple(seq.token_range(end, min(end + k, n_tok)))
        return ()

    def select(self, seqs: list, drafts: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The drafts of one step of B = len(seqs) decoding rows that pay for the batch (see the module doc): rows
        whose expected extra tokens beat what their drafts cost the batch, and those only if together they beat the
        verify path's fixed cost. A probe rides along when the step verifies anyway; it makes the step verify
        (paying that cost) once its wait times sqrt(B) is over, as does a row whose paying-alone drafts were
        dropped that long (its estimate would otherwise never be tested again)."""
        batch = len(seqs)
        scale = math.sqrt(batch)
        keep, riders, value, paid = [()] * batch, [], 0.0, False
        for i, (seq, d) in enumerate(zip(seqs, drafts)):
            if not d:
                continue
            st = seq.spec
            if self.depth(st) == 0:  # a probe (its idle steps are counted by `propose`)
                if st.idle >= st.wait * scale:
                    keep[i], paid = d, True
                else:
                    riders.append(i)
                continue
            if st.idle + 1 >= st.wait * scale:
                keep[i], paid = d, True
                continue
            a = min(st.alpha, 0.999)
            net = a * (1 - a ** len(d)) / (1 - a) - batch * self.cost * len(d)  # expected extra tokens - their cost
            if net > 0:
                keep[i], value = d, value + net
        if paid or value > batch * self.fixed:
            for i in riders:
                keep[i] = drafts[i]
        else:
            keep = [()] * batch
        for seq, d, k in zip(seqs, drafts, keep):
            if d and not k and self.depth(seq.spec) > 0:
                seq.spec.idle += 1
        return keep

    def _index(self, st: SpecState, seq) -> None:
        """Add the n-grams tokens[end - n : end] for the ends not indexed yet that have a following token
        (end < num_tokens), so a lookup finds the latest earlier occurrence, never the suffix itself."""
        last = seq.num_tokens - 1  # the largest end with a follower
        if st.indexed > last:
            return
        lo = max(0, st.indexed - max(self.ns))
        window = seq.token_range(lo, last)
        for end in range(max(st.indexed, 1), last + 1):
            for n in self.ns:
                if end - n >= lo:
                    st.index[(n, tuple(window[end - n - lo : end - lo]))] = end
        st.indexed = last + 1

    @staticmethod
    def record(seq, drafted: int, accepted: int) -> None:
        """Update the sequence's acceptance estimate after verifying `drafted` drafts."""
        st = seq.spec
        if drafted:
            st.alpha = (1 - ALPHA_WEIGHT) * st.alpha + ALPHA_WEIGHT * accepted / drafted
            st.idle = 0
            st.wait = PROBE_AFTER if accepted else min(2 * st.wait, PROBE_MAX)


def accept(seq, drafts: tuple[int, ...], rows: torch.Tensor | list[int], end_ids, grammars) -> list[int]:
    """The tokens a verified piece emits: the accepted drafts, then the row's own pick (1 to len(drafts) + 1
    tokens). rows: the greedy argmax of every row (a list, for rows needing no processing), or the raw logits
    [1 + k, V] (fp32, host)."""
    p = seq.params
    if isinstance(rows, list):
        out = []
        for j, d in enumerate(drafts):
            if rows[j] != d:
                return out + [rows[j]]
            out.append(d)
        return out + [rows[len(drafts)]]
    out: list[int] = []
    view = SimpleNamespace(params=p, prompt_ids=seq.prompt_ids, output_ids=seq.output_ids, grammar=seq.grammar)
    if p.constrained and seq.grammar is None:
        seq.grammar = view.grammar = grammars.state_for(p)
    for j in range(len(drafts) + 1):
        row = rows[j]
        if needs_processing(p):
            view.output_ids = seq.output_ids + out
            row = process(row[None], [view], end_ids, grammars)[0]
        d = drafts[j] if j < len(drafts) else None
        if p.temperature <= 0:
            tok = int(row.argmax())
            if tok != d:
                return out + [tok]
        else:  # the token plain decoding samples here (same call, same generator); the draft stays if it is that
            tok = sample_rows(row[None], [p.temperature], [p.top_p], [p.top_k], [seq.generator], [p.min_p])[0]
            if tok != d:
                return out + [tok]
        out.append(d)
    raise AssertionError("unreachable: the last row always emits")


def rollback_bytes_per_token(units, conv_channels: int, conv_window: int, conv_elem_bytes: int) -> dict[str, int]:
    """Per draft token and sequence, summed over the recurrent layers `units` (UnitGeometry): what replay keeps
    (per head the key, the cumulative gate (K values for KDA, 1 for GDN) and the delta-rule correction, fp32; the
    raw conv input) and what a snapshot keeps (the state, fp32, and the conv window)."""
    replay = snapshot = 0
    for u in units:
        gate = u.d_k if u.kind == "kda" else 1
        replay += 4 * u.heads * (u.d_k + gate + u.d_v) + conv_channels * conv_elem_bytes
        snapshot += 4 * u.heads * u.d_k * u.d_v + conv_channels * conv_window * conv_elem_bytes
    return {"replay": replay, "snapshot": snapshot}
