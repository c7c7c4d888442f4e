"""Speculative decoding, the engine core's side: drafts offered before each step, verified samples turned into the
tokens a sequence keeps, and the counters /metrics and the benchmarks read.

Before scheduling, every decoding sequence is offered the drafts its proposer (engine/drafts.py) continues it with,
as many as draft_plan.choose_drafts finds worth their cost (all of them, up to num_speculative_tokens, when the step
curves were not measured or "adaptive" is off); the scheduler runs a sequence's last token and its drafts as
consecutive decode rows of its slot (a batch-size graph), or as one row of a token-count step when prompts ride
along or the rows outnumber the largest decode batch. After the step, the sequence keeps its samples up to the first that differs from its draft
(runner/speculative.py says why that is exact) and its computed-token count is rolled back over the rejected drafts:
their KV slots are simply written again by later steps.

n-gram drafts and a draft model's are proposed on the device (on_device: runner/speculative.DraftState,
runner/draft_model.py), so the loop stays asynchronous: the host schedules step N+1 while step N runs, counting N's
drafts as kept; N+1's rows take their positions and drafts from the device, which knows N's outcome, and the host
corrects its counts when it reads N. The host's own n-gram proposer, one step behind, only says how many drafts a
sequence is offered (a match in what the host knows predicts one on the device); a draft model is offered k, as the
plan allows. Such drafts run as decode rows only, so the n-gram loop waits for the step in flight whenever a prompt
waits or runs (or a request has penalties or min_tokens, which read the tokens on the host): the host then offers its
own drafts, which equal the device's; a draft model's drafts also ride beside prompts (the runner proposes them
before a token-count step's forward).
Suffix drafts always come from the host, which must know every token before it drafts: that loop reads each step
before scheduling the next (the step just launched is left running while the front end handles the outputs of the
one before) — unless the plan, pricing that wait at the host's measured time a step, finds no draft worth it: then
the step runs asynchronously without drafts, and shadow drafts keep measuring acceptance (worth_waiting). While a
structured-output sequence runs, every method with a host proposer drafts like suffix (its masks follow its drafts:
engine/grammar.py); a draft model then drafts for nobody.
"""
from __future__ import annotations

from nanoserve.engine.draft_plan import StepCosts, VerifyCost, acceptance_rate, choose_drafts, found_rate
from nanoserve.engine.drafts import make_proposer
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.runner.speculative import DEVICE_DRAFT, accepted_count
from nanoserve.runner.startup.bucket_plan import StepCurve
from nanoserve.speculative_config import (BACKED_OFF_TURNS, IDLE_INDEX_TOKENS, SHADOW_DRAFTS_PER_STEP,
                                          SpeculativeConfig)


class Speculator:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, max_decode_rows: int, step_curve=None,
                 token_curve=None, draft_curve=None, verify_curve=None):
        """step_curve / token_curve: the runner's measured step times (None when not measured: no planning);
        draft_curve: a draft model's decode steps' (it proposes: they cost more); verify_curve: a verification's, its
        rows grouped by sequence (draft_plan.VerifyCost); max_decode_rows: the most rows a decode batch (and so a
        verification as decode rows) runs."""
        self.spec, self.max_model_len, self.max_decode_rows = spec, max_model_len, max_decode_rows
        self.on_device = spec.drafts_on_device
        # a draft model proposes on the device only (runner/draft_model.py): the host just says how many
        self.proposer = make_proposer(spec) if spec.method != "draft_model" else None
        planned = spec.adaptive and step_curve is not None and token_curve is not None
        # (looked up per row count: the plan runs every step; a step has at most max_decode_rows × (1 + k) rows)
        upto = max_decode_rows * (1 + spec.num_speculative_tokens)
        table = lambda curve: curve.tabulated(upto) if isinstance(curve, StepCurve) else curve  # noqa: E731
        apart = table(draft_curve if draft_curve is not None else step_curve)
        verify = VerifyCost(apart, table(verify_curve), 1 + spec.num_speculative_tokens) if apart is not None else None
        self._costs = (StepCosts(table(step_curve), table(token_curve), max_decode_rows, verify)
                       if planned else None)
        # host drafts' back-off (worth_waiting): per request, its proposer's (found, asked) counts, and the shadow
        # draft proposed while backed off that its next tokens are checked against ([drafts, matched so far])
        self.backed_off = False
        self._turn, self._shadow_every = 0, 1  # (a sequence gets a shadow draft when its slot's turn comes)
        self._news = True  # backed off: a shadow draft settled or a sequence came or went since the last plan
        self._found: dict[str, list[int]] = {}
        # device drafts (n-gram in the asynchronous loop): per request, (verifications whose device found its drafts,
        # verifications); the host offers rows where its older tokens matched, and the device may then find none
        self._landed: dict[str, list[int]] = {}
        self._shadow: dict[str, list] = {}
        self._due: dict[str, tuple[Sequence, int]] = {}  # shadow drafts to propose (idle, or before the next tokens)
        self.num_drafts = self.draft_tokens = self.accepted_tokens = 0  # rows that verified drafts; drafts; kept
        self.accepted_per_position = [0] * spec.num_speculative_tokens

    # -- a sequence's life --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._news = True
        if self.proposer is not None:
            self.proposer.add(seq.request_id, seq.prompt_token_ids)

    def remove(self, seq: Sequence, keep_outputs: bool) -> None:
        self._news = True
        if self.proposer is not None:
            self.proposer.remove(seq.request_id, keep_outputs)
        self._found.pop(seq.request_id, None)
        self._landed.pop(seq.request_id, None)
        self._shadow.pop(seq.request_id, None)
        self._due.pop(seq.request_id, None)

    # -- before a step ------------------------------------------------------------------------------
    def worth_waiting(self, running: list[Sequence], host_ms: float | None, host: bool = False) -> bool:
        """Host drafts (suffix; any method's proposer while a constrained sequence runs: host=True) need every token
        before drafting: the loop waits for the step in flight, so a verifying step costs the host's time on top of
        the device's, while a plain one overlaps them. True when the plan at that price keeps any draft (always,
        without measured curves or host time). While it says no, the sequences are backed off: they decode in the
        asynchronous loop and their acceptance keeps being measured against shadow drafts (extend), so drafting
        resumes when it pays again. Backed off, the plan is priced again every BACKED_OFF_TURNS steps, or sooner when
        a shadow draft settled or a sequence came or went."""
        if (self.on_device and not host) or self._costs is None or host_ms is None:
            self.backed_off = False
            return True
        if self.backed_off and not self._news and self._turn % BACKED_OFF_TURNS:
            self._turn += 1
            return False
        self._news = False
        rows = [s for s in running if s.decoding and not s.is_finished]
        k = self.spec.num_speculative_tokens
        lengths = [min(k, s.draft_room(self.max_model_len)) for s in rows]
        rates = [acceptance_rate(s.num_accepted, s.num_drafted) for s in rows]
        found = [found_rate(*self._found.get(s.request_id, (0, 0))) for s in rows]
        keep = choose_drafts(lengths, rates, self._costs(len(lengths), sum(lengths)), host_ms, found)
        self.backed_off = not any(keep)
        self._turn += 1
        self._shadow_every = max(-(-len(rows) // SHADOW_DRAFTS_PER_STEP), BACKED_OFF_TURNS)
        return not self.backed_off

    def loop_waits(self) -> None:
        """The loop reads every step anyway (penalties, synchronous scheduling): host drafts cost no extra wait."""
        self.backed_off = False

    def offer(self, running: list[Sequence], on_device: bool = False) -> None:
        """Set each decoding sequence's draft_token_ids for the next schedule (the scheduler may run fewer).
        on_device: the step is scheduled before the one in flight is read (drafts from the device, decode rows only);
        otherwise the host knows every token and offers its own drafts. A draft model's drafts always come from the
        device, so a request with penalties (which read its drafts on the host) is offered none."""
        rows = [s for s in running if s.decoding and not s.is_finished]
        k = self.spec.num_speculative_tokens
        if self.backed_off:  # (host drafts the plan found not worth waiting for: see worth_waiting)
            k = 0
        if self.proposer is None:
            offered = [[] if s.params.uses_penalties else [DEVICE_DRAFT] * min(k, s.draft_room(self.max_model_len))
                       for s in rows]
        else:
            offered = [self._propose(s, min(k, s.draft_room(self.max_model_len))) for s in rows]
        if self._costs is not None and any(offered):
            rates = [acceptance_rate(s.num_accepted, s.num_drafted) for s in rows]
            lengths = [len(d) for d in offered]
            landed = ([found_rate(*self._landed.get(s.request_id, (0, 0))) for s in rows]
                      if on_device and self.proposer is not None else None)
            keep = choose_drafts(lengths, rates, self._costs(len(lengths), sum(lengths)), weights=landed)
            if self.proposer is not None:
                self._shadow_cut(rows, offered, keep)
            offered = [d[:n] for d, n in zip(offered, keep)]
        if on_device or self.proposer is None:
            offered = self._device_drafts(offered, self.max_decode_rows - len(rows))
        for seq, drafts in zip(rows, offered):
            seq.draft_token_ids = drafts

    def _shadow_cut(self, rows: list[Sequence], offered: list[list[int]], keep: list[int]) -> None:
        """A sequence the plan gives no drafts keeps its proposer's as a shadow draft, settled by the tokens that
        follow (extend): its acceptance rate goes on being measured. Otherwise a rate that fell (drafts rejected where
        the text does not repeat) would stay where it fell, and the plan would never draft for it again, when later
        text repeats. (Host drafts continue what the host knows, so they predict exactly the tokens appended next.)"""
        for seq, drafts, n in zip(rows, offered, keep):
            if not n and seq.request_id not in self._shadow:
                self._keep_shadow(seq.request_id, drafts)

    @staticmethod
    def _device_drafts(offered: list[list[int]], room: int) -> list[list[int]]:
        """As many device drafts as the host's proposer found, within `room` extra decode rows (one batch): when they
        do not fit, an equal share each, so a sequence's drafts (and a seeded one's draws) do not depend on the order
        of the rows."""
        share = len(max(offered, key=len, default=[])) if sum(map(len, offered)) <= room else room // len(offered)
        return [[DEVICE_DRAFT] * min(len(d), share) for d in offered]

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0:
            return []
        drafts = self.proposer.propose(seq.request_id, k)
        counts = self._found.setdefault(seq.request_id, [0, 0])
        counts[0] += bool(drafts)
        counts[1] += 1
        return drafts

    # -- while a step runs ---------------------------------------------------------------------------
    def idle(self, ready) -> None:
        """The loop waits for a step's tokens (ready(): they are): meanwhile the host proposer indexes what its next
        proposals would (drafts.Proposer.work), IDLE_INDEX_TOKENS at a time, and the shadow drafts due are proposed
        (after the indexing: a proposal does whatever indexing still waits at once), so that host time is the
        device's."""
        if self.proposer is None:
            return
        while not ready() and self.proposer.work(IDLE_INDEX_TOKENS):
            pass
        while self._due and not ready():
            self._shadow_draft(*self._due.pop(next(iter(self._due))))

    # -- after a step -------------------------------------------------------------------------------
    def verified(self, seq: Sequence, drafts: list[int], samples: list[int]) -> list[int]:
        """The tokens seq keeps from a step that verified `drafts` (samples: its rows' samples): the accepted drafts
        and the sample after them. Rolls its computed tokens back over the rejected drafts."""
        a, found = accepted_count(samples, drafts), sum(d >= 0 for d in drafts)
        if seq.status is SequenceStatus.RUNNING:  # (preempted while the step ran: its blocks and counts are gone)
            seq.num_computed_tokens -= len(drafts) - a
        # Rows the device found no draft for (-1) are not rejected drafts: they count against the chance that the
        # device finds what the host offered (_landed, the plan's weight), not against the acceptance rate, which
        # they would lower at every position (the geometric model) where a miss loses the verification's drafts whole
        seq.num_drafted += found
        seq.num_accepted += a
        if self.on_device and self.proposer is not None:  # (read only where a host proposer sizes device drafts)
            landed = self._landed.setdefault(seq.request_id, [0, 0])
            landed[0] += found > 0
            landed[1] += 1
        self.num_drafts += 1
        self.draft_tokens += found
        self.accepted_tokens += a
        for j in range(a):
            self.accepted_per_position[j] += 1
        return samples[:a + 1]

    def extend(self, seq: Sequence, tokens: list[int]) -> None:
        """Tokens seq appended: they settle its shadow draft, join its proposer's index, and (backed off) a new
        shadow draft is due from them: proposed while the loop waits (idle), else before the next tokens arrive."""
        if self.proposer is None:
            return
        rid = seq.request_id
        if rid in self._due:
            self._shadow_draft(*self._due.pop(rid))
        if rid in self._shadow:
            self._check_shadow(seq, tokens)
        self.proposer.extend(rid, tokens)
        if self.backed_off and rid not in self._shadow and ((seq.slot or 0) + self._turn) % self._shadow_every == 0:
            self._due[rid] = seq, min(self.spec.num_speculative_tokens, seq.draft_room(self.max_model_len))

    def _shadow_draft(self, seq: Sequence, k: int) -> None:
        self._keep_shadow(seq.request_id, self._propose(seq, k))

    def _keep_shadow(self, request_id: str, drafts: list[int]) -> None:
        """drafts (if any) as the sequence's shadow draft: [drafts, tokens matched so far], settled by extend."""
        if drafts:
            self._shadow[request_id] = [list(drafts), 0]

    def _check_shadow(self, seq: Sequence, tokens: list[int]) -> None:
        """Count a shadow draft like a verified one (drafted, accepted) once its tokens settle it: at the first
        token that differs, or when every draft matched."""
        shadow = self._shadow[seq.request_id]
        drafts, matched = shadow
        for token in tokens:
            if token != drafts[matched]:
                break
            matched += 1
            if matched == len(drafts):
                break
        else:
            shadow[1] = matched  # (every new token matched: the rest is still to come)
            return
        del self._shadow[seq.request_id]
        seq.num_drafted += len(drafts)
        seq.num_accepted += matched
        self._news = True

    def stats(self) -> dict:
        """The EngineStats fields of speculation."""
        return {"spec_method": self.spec.method, "spec_num_drafts": self.num_drafts,
                "spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_accepted_per_position": list(self.accepted_per_position)}


__all__ = ["Speculator"]
