"""The engine model proper: a synchronous, clock-free continuous-batching scheduler.

`Scheduler` is driven by whoever owns time: the async `Engine` (wall or virtual clock) or
`calibrate.closed_loop` (a plain loop over virtual time). The driver asks `next_time()`, then
calls `advance(t)`; `submit()`/`abort()` may come at any time in between. Nothing here sleeps,
so the same scheduling decisions happen on every clock and, for a seed, every time.

Model (details and the cost formulas in docs/simulator-engine.md):

- Work is organised in *slots* (micro-batches). tp/ep profiles have one slot: the running
  batch. pp profiles have S + async-depth slots, as SGLang's PP event loop; a request is
  admitted into the slot being scheduled and keeps it for life.
- Stage 0 visits slots in strict cyclic order. Visiting slot m waits until m's previous pass
  came back and stage 0 is free; it then (1) makes room in the KV pool for the slot's decode
  tokens, retracting its least-advanced requests if the pool is full, (2) admits waiting
  requests FCFS into the slot (micro-batch cap, max_running_requests, KV pool with a
  new_token_ratio reserve, chunked-prefill budget), and (3) launches one pass. Empty slots are
  skipped at no cost.
- A pass costs `step_cost_ms` (decode tokens + prefill tokens, batched together; times a
  seeded log-normal factor of mean 1 if the profile sets `step_noise`). tp/ep: the
  slot is busy for that long. pp: each of the S stages is busy cost/S in turn, with a hand-off
  latency between stages; a stage works on one micro-batch at a time, so with fewer non-empty
  slots than stages most stages idle, and a request advances one token per loop.
- At the end of a pass each request in it that finished prefill gets one token; requests that
  reach their length finish and free their KV tokens.
- Prefix cache (RadixAttention; on unless the engine is built with ``radix_cache=False``, and
  only for requests that carry their prompt's token ids): admission matches the prompt against
  a radix tree of cached token prefixes (loadtest/sim/prefix_cache.py) and prefills only the
  rest; the matched prefix is locked while the request runs. A request's prompt is inserted
  once its prefill is done (locked while it runs; SGLang's cache_unfinished_req), so requests
  admitted after that match it, and its output when it finishes, so its KV stays in the pool
  as cache (a retracted request's prompt stays as cache too). Cached tokens no running request
  uses are evictable: admission counts them as room and takes it by evicting least recently
  used leaves, and decode evicts them before it retracts anyone. The gauges count used tokens
  without the evictable ones, as SGLang's ``num_used_tokens`` does.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from loadtest.sim.prefix_cache import CacheNode, PrefixCache
from loadtest.sim.profiles import Profile
from loadtest.sim.tokens import EOS_TOKEN_ID, TokenSource, stable_seed

FinishType = Literal["length", "stop", "abort"]


class DuplicateRequestError(ValueError):
    """submit() of a rid that is still live (the HTTP layer answers 400)."""


@dataclass(slots=True, frozen=True)
class Finish:
    """Why a request ended, as SGLang's finish_reason (`type` + its detail)."""

    type: FinishType
    length: int | None = None  # 'length': tokens generated
    matched: int | str | None = None  # 'stop': the EOS token id (or stop string)
    message: str | None = None  # 'abort'
    status_code: int | None = None  # 'abort': HTTP status a server should answer with
    err_type: str | None = None


@dataclass(slots=True)
class GenRequest:
    """What the HTTP layer asks the engine for (token counts only; text is the server's)."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    ignore_eos: bool = False
    seed_key: str | None = None  # keys the generated ids and natural length; default: rid
    cached_tokens: int = 0  # prompt tokens already in a prefix cache (not prefilled again)
    # the prompt's token ids: the radix cache matches and keeps them (None: counts only, no
    # cache; prompt_tokens is then the length)
    prompt_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class EngineStats:
    """Scheduler gauges, under the attribute names SGLang's metrics use (minus 'sglang:')."""

    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_grammar_queue_reqs: int = 0
    num_used_tokens: int = 0
    token_usage: float = 0.0
    max_total_num_tokens: int = 0
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0
    num_retracted_reqs: int = 0
    utilization: float = 0.0
    time: float = 0.0  # modelled time these values describe


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters (SGLang's *_total), updated when requests finish, as SGLang does."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    requests_total: int = 0
    aborted_total: int = 0
    retractions_total: int = 0
    retracted_input_tokens_total: int = 0
    retracted_output_tokens_total: int = 0
    decode_steps_total: int = 0
    prefill_batches_total: int = 0


# emit(req, new token ids, finish or None)
EmitFn = Callable[["Req", list[int], Finish | None], None]


@dataclass(eq=False, slots=True)
class Req:
    """One request's state inside the scheduler."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    target: int  # tokens to generate, then finish with `finish_type`
    finish_type: FinishType
    arrival: float
    source: TokenSource
    cached_tokens: int = 0
    generated: int = 0
    prefill_left: int = 0  # tokens to prefill before the next token comes out
    kv: int = 0  # KV pool tokens held
    slot: int | None = None
    num_retractions: int = 0
    state: Literal["waiting", "running", "done"] = "waiting"
    t_admitted: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    finish: Finish | None = None
    prompt_ids: tuple[int, ...] | None = None  # for the radix cache (None: not cached)
    out_ids: list[int] | None = None  # generated ids, kept to cache them at the finish
    node: CacheNode | None = None  # the cached prefix it holds locked while running
    hit: int = 0  # tokens of its prompt the cache held when it was last admitted

    @property
    def remaining(self) -> int:
        return max(self.target - self.generated, 0)


@dataclass(slots=True)
class _Pass:
    slot: int
    t_done: float
    reqs: list[tuple[Req, bool]]  # (request, gets a token at the end of this pass)
    decode_tokens: int
    prefill_tokens: int


def active_experts(profile: Profile, tokens: int) -> float:
    """Expected distinct experts a batch of `tokens` tokens routes to (per layer)."""
    if tokens <= 0:
        return 0.0
    e, k = profile.effective_experts, profile.experts_per_token
    return e * (1.0 - (1.0 - k / e) ** tokens)


def step_cost_ms(profile: Profile, decode_tokens: int, prefill_tokens: int = 0) -> float:
    """Busy time of one pass over the whole model (pp: summed over stages, hand-offs excluded).

    compute = overhead + dense weights + routed-expert reads (distinct experts) + per-token
    compute + prefill. Collectives differ by parallelism:
    tp: every layer all-reduces every token's hidden state on all ranks:
        L * ops * (latency + us_per_token * b).
    ep: every MoE layer does an all-to-all dispatch + combine; with data-parallel attention each
        rank only sends its own b/dp tokens, so: L * ops * (latency + us_per_token * ceil(b/dp)),
        and per-token attention compute is also per rank: compute_ms_per_token * ceil(b/dp).
    pp: no collectives; stage hand-offs are added by the pipeline timing, not here.
    """
    p = profile
    b = decode_tokens
    per_rank = math.ceil(b / p.dp_size) if p.parallelism == "ep" else b
    ms = (
        p.step_overhead_ms
        + p.weights_ms
        + p.expert_read_ms * active_experts(p, b) / p.experts_per_token
        + p.compute_ms_per_token * per_rank
        + p.prefill_ms_per_token * prefill_tokens
    )
    if p.parallelism in ("tp", "ep"):
        ms += (
            p.num_layers
            * p.comm_ops_per_layer
            * (p.comm_latency_us + p.comm_us_per_token * per_rank)
            / 1000.0
        )
    return ms


def handoff_ms(profile: Profile, tokens: int) -> float:
    """pp: time to pass one micro-batch's activations from a stage to the next."""
    return profile.p2p_latency_ms + profile.p2p_us_per_token * tokens / 1000.0


def noise_factor(rng: random.Random, sigma: float) -> float:
    """A log-normal factor with mean 1 (``exp(sigma z - sigma^2 / 2)``, z standard normal).

    Mean 1 keeps a profile's calibrated throughput while its step times jitter.
    """
    return math.exp(sigma * rng.gauss(0.0, 1.0) - sigma * sigma / 2.0)


#: SGLang's adaptive admission reserve (SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR,
#: SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS, SGLANG_RETRACT_DECODE_STEPS): the ratio starts at the
#: profile's ``new_token_ratio``, falls by (start - floor) / DECAY_STEPS per decode pass to
#: start x MIN_FACTOR, is re-estimated from the batch on a retraction and restarts when idle
NEW_TOKEN_RATIO_MIN_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


class Scheduler:
    """Continuous batching over slots; see the module docstring."""

    def __init__(
        self,
        profile: Profile,
        seed: int = 0,
        emit: EmitFn | None = None,
        make_ids: bool = True,
        radix_cache: bool = True,
    ) -> None:
        self.profile = profile
        self.cache = PrefixCache() if radix_cache else None
        self._hit_tokens = 0  # prompt tokens of admissions since the last prefill log: cached
        self._input_tokens = 0  # ... and all of them (cache_hit_rate)
        self.make_ids = make_ids  # False: emit placeholder ids (calibration needs counts only)
        self.seed = seed
        self.emit: EmitFn = emit or (lambda req, ids, fin: None)
        self.num_slots = profile.num_slots
        self.stages = profile.stages
        self.cap = profile.micro_batch_cap
        self.slots: list[list[Req]] = [[] for _ in range(self.num_slots)]
        self.waiting: deque[Req] = deque()
        self.reqs: dict[str, Req] = {}
        self.counters = EngineCounters()
        self.used_tokens = 0
        self.num_running = 0
        r0 = profile.new_token_ratio
        self._ratio_floor = r0 * NEW_TOKEN_RATIO_MIN_FACTOR
        self._ratio_decay = (r0 - self._ratio_floor) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = r0
        self._passes: list[tuple[float, int, _Pass]] = []  # heap by (t_done, seq)
        self._in_flight: dict[int, _Pass] = {}
        self._seq = 0
        self._stage_free = [0.0] * self.stages
        self._cursor = 0
        self._now = 0.0
        # logged (stale) gauges, as SGLang's log_prefill_stats / log_decode_stats write them
        self._logged = EngineStats(max_total_num_tokens=profile.max_total_tokens)
        self._decode_ct = 0
        self._log_tokens = 0
        self._log_t = 0.0
        self._log_retracted = 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) for live throughput
        self._busy_ms = 0.0
        # step_noise draws from its own stream (none at all when 0), so a noise-free profile
        # schedules exactly as before and a noisy one repeats for a seed
        self._noise = (
            random.Random(stable_seed(seed, "step-noise")) if profile.step_noise > 0 else None
        )

    # --- requests ---------------------------------------------------------------------------
    def submit(self, g: GenRequest, now: float) -> Req:
        """Queue a request (never blocks). DuplicateRequestError if the rid is live."""
        self._now = max(self._now, now)
        key = g.seed_key if g.seed_key is not None else g.rid
        target, ftype = self._target_length(g, key)
        ids = g.prompt_ids if self.cache is not None and g.prompt_ids else None
        req = Req(
            rid=g.rid,
            prompt_tokens=len(ids) if ids is not None else max(int(g.prompt_tokens), 1),
            max_new_tokens=max(int(g.max_new_tokens), 0),
            target=target,
            finish_type=ftype,
            arrival=self._now,
            source=TokenSource(self.seed, key),
            cached_tokens=min(max(int(g.cached_tokens), 0), max(int(g.prompt_tokens) - 1, 0)),
            prompt_ids=ids,
            out_ids=[] if ids is not None else None,
        )
        if req.rid in self.reqs:  # SGLang rejects a live duplicate rid
            raise DuplicateRequestError(f"request id {req.rid!r} is already running")
        if self.num_running == 0 and not self.waiting:  # idle: SGLang restarts its estimate
            self.new_token_ratio = self.profile.new_token_ratio
        self._spin()
        self.reqs[req.rid] = req
        if req.prompt_tokens + 1 > self.profile.max_total_tokens:
            self._finish(
                req,
                Finish(
                    "abort",
                    message=f"prompt of {req.prompt_tokens} tokens does not fit the KV pool "
                    f"({self.profile.max_total_tokens} tokens)",
                    status_code=400,
                    err_type="BadRequestError",
                ),
            )
            return req
        self.waiting.append(req)
        return req

    def _target_length(self, g: GenRequest, key: str) -> tuple[int, FinishType]:
        cap = max(int(g.max_new_tokens), 0)
        if g.ignore_eos:
            return cap, "length"
        natural = self.natural_length(key)
        if natural <= cap:
            return natural, "stop"
        return cap, "length"

    def natural_length(self, key: str) -> int:
        """Answer length without ignore_eos: log-normal(median, sigma), for (seed, key)."""
        p = self.profile
        rng = random.Random(stable_seed(self.seed, f"len:{key}"))
        n = round(p.output_len_median * math.exp(p.output_len_sigma * rng.gauss(0.0, 1.0)))
        return max(n, p.output_len_min)

    def abort(
        self, rid: str, message: str = "Abort request", status_code: int | None = None
    ) -> bool:
        """Abort a live request at once: its slot and KV tokens are freed. False if unknown."""
        req = self.reqs.get(rid)
        if req is None or req.state == "done":
            return False
        if req.state == "waiting":
            self.waiting.remove(req)
        self._finish(req, Finish("abort", message=message, status_code=status_code))
        return True

    def abort_all(self, message: str = "Abort request", status_code: int | None = None) -> int:
        rids = [r.rid for r in self.reqs.values() if r.state != "done"]
        return sum(self.abort(rid, message, status_code) for rid in rids)

    def _finish(self, req: Req, finish: Finish, ids: list[int] | None = None) -> None:
        if req.state == "running":
            self.slots[req.slot].remove(req)  # type: ignore[index]
            self.num_running -= 1
            if finish.type != "abort" and req.out_ids is not None:
                req.out_ids.extend(ids or [])
                self._cache_finished(req)
        self._unlock(req)
        self.used_tokens -= req.kv
        req.kv = 0
        req.state = "done"
        req.finish = finish
        req.slot = None
        del self.reqs[req.rid]
        c = self.counters
        c.requests_total += 1
        c.prompt_tokens_total += req.prompt_tokens
        c.generation_tokens_total += req.generated
        c.cached_tokens_total += req.cached_tokens
        if finish.type == "abort":
            c.aborted_total += 1
        self.emit(req, ids or [], finish)

    # --- time -------------------------------------------------------------------------------
    def next_time(self) -> float | None:
        """When the scheduler next has something to do; None = idle until a submit."""
        t = self._passes[0][0] if self._passes else None
        m = self._cursor
        if m not in self._in_flight and (self.slots[m] or self.waiting):
            s = max(self._stage_free[0], self._now)
            t = s if t is None else min(t, s)
        return t

    def advance(self, now: float) -> None:
        """Run everything due up to `now` (in order), then schedule at `now`."""
        stuck = 0
        while True:
            t = self.next_time()
            if t is None or t > now:
                break
            before = (self._seq, len(self._passes), len(self.waiting), self.num_running)
            self._step(t)
            after = (self._seq, len(self._passes), len(self.waiting), self.num_running)
            stuck = stuck + 1 if after == before else 0
            if stuck > self.num_slots + 1:  # nothing can move (should not happen): stop
                break
        self._now = max(self._now, now)
        self._dispatch()

    def _step(self, t: float) -> None:
        self._now = max(self._now, t)
        while self._passes and self._passes[0][0] <= self._now:
            _, _, ps = heapq.heappop(self._passes)
            self._complete(ps)
        self._dispatch()

    # --- passes -----------------------------------------------------------------------------
    def _complete(self, ps: _Pass) -> None:
        del self._in_flight[ps.slot]
        now = ps.t_done  # (== self._now unless the driver fell behind)
        produced = 0
        for req, gets_token in ps.reqs:
            if req.state != "running" or req.slot != ps.slot or not gets_token:
                continue
            if req.target == 0:  # max_new_tokens=0: prefill only
                self._finish(req, Finish("length", length=0))
                continue
            if req.generated == 0 and req.prompt_ids is not None and self.cache is not None:
                self._cache_unfinished(req)
            req.generated += 1  # its KV token was allocated when the pass launched
            produced += 1
            if req.t_first is None:
                req.t_first = now
            req.t_last = now
            done = req.generated >= req.target
            if done and req.finish_type == "stop":
                ids = [EOS_TOKEN_ID]
                fin = Finish("stop", matched=EOS_TOKEN_ID)
            else:
                ids = req.source.take(1) if self.make_ids else [0]
                fin = Finish("length", length=req.generated) if done else None
            if fin is None:
                if req.out_ids is not None:
                    req.out_ids.extend(ids)
                self.emit(req, ids, None)
            else:
                self._finish(req, fin, ids)
        if produced:
            self._recent.append((now, produced))
            self._log_tokens += produced
            while self._recent[0][0] < now - 1.0:  # keep one modelled second
                self._recent.popleft()

    def _spin(self) -> None:
        """Move the cursor past empty slots while stage 0 is idle and nobody waits.

        SGLang's PP loop spins through empty micro-batches and blocks on the next one in
        flight; a request arriving later joins that one when it returns. Doing this at submit
        time (not only when the driver happens to call) keeps decisions independent of when
        the driver wakes.
        """
        if self.waiting:
            return
        for _ in range(self.num_slots):
            m = self._cursor
            if m in self._in_flight or self.slots[m] or self._stage_free[0] > self._now:
                return
            self._cursor = (m + 1) % self.num_slots

    def _dispatch(self) -> None:
        for _ in range(self.num_slots):
            m = self._cursor
            if m in self._in_flight or self._stage_free[0] > self._now:
                return
            launched = self._launch(m)
            self._cursor = (m + 1) % self.num_slots
            if launched and self.stages == 1:
                return

    def _reserve(self) -> float:
        r = self.new_token_ratio
        if r <= 0:
            return 0.0
        return r * sum(q.remaining for s in self.slots for q in s)

    def _launch(self, m: int) -> bool:
        p = self.profile
        now = self._now
        slot = self.slots[m]
        # 1. room for this slot's decode tokens; retract the least advanced if the pool is full
        retracted = False
        decoders = [q for q in slot if q.prefill_left == 0]
        self._make_room(len(decoders))
        while decoders and self.used_tokens + len(decoders) > p.max_total_tokens:
            if len(decoders) == 1 and self.num_running == 1:
                victim = decoders[0]
                self._finish(
                    victim,
                    Finish("abort", message="KV cache pool is full", status_code=503),
                )
                decoders = []
                break
            victim = min(decoders, key=lambda q: (q.generated, -q.prompt_tokens))
            decoders.remove(victim)
            self._retract(victim)
            retracted = True
        if retracted and decoders:
            # SGLang's retract_decode: the ratio the remaining batch shows it needs
            done = sum(q.generated for q in decoders) + RETRACT_DECODE_STEPS * len(decoders)
            self.new_token_ratio = min(1.0, done / max(sum(q.target for q in decoders), 1))
        elif decoders:
            self.new_token_ratio = max(self.new_token_ratio - self._ratio_decay, self._ratio_floor)
        # 2. admission (not right after a retraction: the pool is known to be full)
        budget = p.chunked_prefill_size
        chunks: list[tuple[Req, int]] = []
        for q in slot:  # continuing chunked prefills first
            if q.prefill_left > 0 and budget > 0:
                n = min(q.prefill_left, budget)
                chunks.append((q, n))
                budget -= n
        if not retracted and budget > 0 and self.waiting:
            reserve = self._reserve()
            while self.waiting and budget > 0:
                if len(slot) >= self.cap or self.num_running >= p.max_running_requests:
                    break
                q = self.waiting[0]
                node, hit = self._match(q)
                need = q.prompt_tokens + q.generated - hit  # (re-)prefill past the cached prefix
                room = p.max_total_tokens + self._evictable() - self._lock_cost(node)
                if need + 1 > p.max_total_tokens:  # can never fit again
                    self.waiting.popleft()
                    self._finish(
                        q, Finish("abort", message="KV cache pool is full", status_code=503)
                    )
                    continue
                new_reserve = self.new_token_ratio * q.remaining
                if self.used_tokens + need + 1 + reserve + new_reserve > room:
                    if self.num_running == 0 and self.used_tokens + need + 1 <= room:
                        pass  # an empty engine always admits what fits
                    else:
                        break
                self.waiting.popleft()
                self._hold(q, node, hit, need)
                reserve += new_reserve
                q.state = "running"
                q.slot = m
                q.t_admitted = now if q.t_admitted is None else q.t_admitted
                q.kv = need
                self.used_tokens += need
                given = q.cached_tokens if q.generated == 0 and q.prompt_ids is None else 0
                q.prefill_left = need - given
                slot.append(q)
                self.num_running += 1
                n = min(q.prefill_left, budget)
                chunks.append((q, n))
                budget -= n
        if not slot:
            return False
        # 3. launch one pass
        prefill_tokens = 0
        reqs: list[tuple[Req, bool]] = [(q, True) for q in decoders]
        for q, n in chunks:
            q.prefill_left -= n
            prefill_tokens += n
            reqs.append((q, q.prefill_left == 0))
        if not reqs:
            return False
        # KV for the token each request will produce is allocated now, as SGLang allocates
        # out_cache_loc when it prepares the batch (checked above for decoders, at admission
        # for prefills)
        for q, gets_token in reqs:
            if gets_token and q.target > 0:
                q.kv += 1
                self.used_tokens += 1
        cost = self.pass_cost_ms(len(decoders), prefill_tokens) / 1000.0
        self._busy_ms += cost * 1000.0
        if self.stages == 1:
            t_done = now + cost
            self._stage_free[0] = t_done
        else:
            busy = cost / self.stages
            hop = handoff_ms(p, len(decoders) + prefill_tokens) / 1000.0
            arrive = now
            for k in range(self.stages):
                start = max(arrive, self._stage_free[k])
                end = start + busy
                self._stage_free[k] = end
                arrive = end + hop
            t_done = arrive
        ps = _Pass(m, t_done, reqs, len(decoders), prefill_tokens)
        self._in_flight[m] = ps
        self._seq += 1
        heapq.heappush(self._passes, (t_done, self._seq, ps))
        # SGLang's gauges: written on prefill batches and every decode_log_interval decodes
        # num_running_reqs as SGLang logs it: the running batch (under PP: this micro-batch)
        # without the requests being prefilled (len(self.running_batch.reqs))
        if prefill_tokens:
            self.counters.prefill_batches_total += 1
            self._log(len(decoders), decode=False)
        if decoders:
            self.counters.decode_steps_total += 1
            self._decode_ct += 1
            if self._decode_ct % p.decode_log_interval == 0:
                self._log(len(decoders), decode=True)
        return True

    def pass_cost_ms(self, decode_tokens: int, prefill_tokens: int) -> float:
        """One pass's busy time: ``step_cost_ms`` times a fresh noise factor if the profile has
        ``step_noise`` (each call draws one)."""
        ms = step_cost_ms(self.profile, decode_tokens, prefill_tokens)
        if self._noise is not None:
            ms *= noise_factor(self._noise, self.profile.step_noise)
        return ms

    def _retract(self, req: Req) -> None:
        """Back to the waiting queue's front; its KV is dropped (re-prefilled on readmission)."""
        self.slots[req.slot].remove(req)  # type: ignore[index]
        self.num_running -= 1
        self._unlock(req)
        self.used_tokens -= req.kv
        req.kv = 0
        req.prefill_left = 0
        req.slot = None
        req.state = "waiting"
        req.num_retractions += 1
        self.waiting.appendleft(req)
        c = self.counters
        c.retractions_total += 1
        c.retracted_input_tokens_total += req.prompt_tokens
        c.retracted_output_tokens_total += req.generated
        self._log_retracted += 1

    # --- prefix cache -----------------------------------------------------------------------
    def _match(self, q: Req) -> tuple[CacheNode | None, int]:
        """The cached prefix of q's prompt (at least its last token is computed, as SGLang)."""
        if self.cache is None or q.prompt_ids is None:
            return None, 0
        node, hit = self.cache.match(q.prompt_ids, len(q.prompt_ids) - 1)
        return (node, hit) if hit else (None, 0)

    def _lock_cost(self, node: CacheNode | None) -> int:
        return 0 if node is None or self.cache is None else self.cache.lock_cost(node)

    def _evictable(self) -> int:
        return 0 if self.cache is None else self.cache.evictable_size

    def _make_room(self, tokens: int) -> None:
        """Evict cached prefixes no running request uses until ``tokens`` more fit the pool."""
        short = self.used_tokens + tokens - self.profile.max_total_tokens
        if short > 0 and self.cache is not None:
            self.used_tokens -= self.cache.evict(short)

    def _hold(self, q: Req, node: CacheNode | None, hit: int, need: int) -> None:
        """q is admitted on a cached prefix of ``hit`` tokens: lock it, find room for the
        ``need`` tokens it computes, count the hit (its first admission only)."""
        if node is not None and self.cache is not None:
            self.cache.lock(node)
            q.node = node
        q.hit = hit
        self._make_room(need + 1)
        if q.prompt_ids is not None and q.generated == 0 and q.num_retractions == 0:
            q.cached_tokens = hit
            self._hit_tokens += hit
            self._input_tokens += q.prompt_tokens

    def _unlock(self, req: Req) -> None:
        if req.node is not None and self.cache is not None:
            self.cache.unlock(req.node)
        req.node = None

    def _cache_unfinished(self, req: Req) -> None:
        """Its prompt is prefilled: the tree takes it now, locked while the request runs, so a
        request admitted later matches it without waiting for this one to finish (SGLang's
        cache_unfinished_req). Its own copy of the prompt moves to the tree; what the tree
        already held (another request cached the same prompt meanwhile) is freed."""
        assert self.cache is not None and req.prompt_ids is not None
        node, already = self.cache.insert(req.prompt_ids)
        self.cache.lock(node)
        self._unlock(req)
        req.node = node
        own = len(req.prompt_ids) - req.hit  # the prompt tokens it computed and held
        req.kv -= own
        self.used_tokens -= already - req.hit  # duplicates of what the tree held

    def _cache_finished(self, req: Req) -> None:
        """Its prompt and output become cache: the tree takes what it did not hold (the
        request's own tokens are freed by the caller), as SGLang's cache_finished_req."""
        assert self.cache is not None and req.prompt_ids is not None and req.out_ids is not None
        ids = req.prompt_ids + tuple(req.out_ids)
        _, already = self.cache.insert(ids)
        self.used_tokens += len(ids) - already

    def flush_cache(self) -> bool:
        """``/flush_cache``: drop every cached prefix; only while nothing runs or waits."""
        if self.num_running or self.waiting:
            return False
        if self.cache is not None:
            self.used_tokens -= self.cache.total_size
            self.cache.reset()
        return True

    # --- stats ------------------------------------------------------------------------------
    def live_stats(self) -> EngineStats:
        """The true current values (whole engine)."""
        now = self._now
        while self._recent and self._recent[0][0] < now - 1.0:
            self._recent.popleft()
        window = min(1.0, now) if now > 0 else 1.0
        return EngineStats(
            num_running_reqs=self.num_running,
            num_queue_reqs=len(self.waiting),
            num_used_tokens=self._used_not_evictable(),
            token_usage=self._used_not_evictable() / self.profile.max_total_tokens,
            max_total_num_tokens=self.profile.max_total_tokens,
            gen_throughput=sum(n for _, n in self._recent) / window,
            num_retracted_reqs=0,
            time=now,
        )

    def _used_not_evictable(self) -> int:
        return self.used_tokens - self._evictable()

    def logged_stats(self) -> EngineStats:
        """What SGLang's scheduler gauges show: the values at the last log point."""
        return replace(self._logged)

    def _log(self, running_batch: int, *, decode: bool) -> None:
        """SGLang's log_prefill_stats / log_decode_stats: write the gauges."""
        lg = self._logged
        lg.num_running_reqs = running_batch
        lg.num_queue_reqs = len(self.waiting)
        lg.num_used_tokens = self._used_not_evictable()
        lg.token_usage = lg.num_used_tokens / self.profile.max_total_tokens
        if not decode and self._input_tokens:  # SGLang: hit / prompt tokens of the batch
            lg.cache_hit_rate = self._hit_tokens / self._input_tokens
            self._hit_tokens = self._input_tokens = 0
        lg.max_total_num_tokens = self.profile.max_total_tokens
        lg.num_retracted_reqs = self._log_retracted  # retractions since the previous log
        self._log_retracted = 0
        lg.time = self._now
        if decode:  # only decode logs recompute gen_throughput
            gap = self._now - self._log_t
            lg.gen_throughput = self._log_tokens / gap if gap > 0 else 0.0
            self._log_tokens = 0
            self._log_t = self._now
