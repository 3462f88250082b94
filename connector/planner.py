"""One P/D turn's decisions: which prefill pod, which decode pod, pull or recompute, and the params.

A router calls :meth:`PDPlanner.plan` once per turn (no HTTP inside), sends P
the returned ``prefill_params`` (with ``max_tokens`` 1, ``stream`` false), gets
D's params from P's answer with :meth:`PDPlanner.decode_params`, sends D the
request, and hands D's answer to :meth:`PDPlanner.decode_answered`, which
refreshes the conversation's retained entry (:mod:`connector.retained`).  When
P or D fails on a turn that pulled, :meth:`PDPlanner.fallback` gives the same
turn without remote params (counted).

Decisions (all explained in :attr:`TurnPlan.reasons`):

- **P**: the weighted picker over the prefill candidates, from their own
  prefix hits in the index (local KV) and their load.
- **Pull or recompute**: pull only when the conversation has a live retained
  entry whose decode pod is still a candidate, the guard
  (:func:`connector.guard.clip_to_prompt`) leaves something reusable, and
  ``pullable - local >= recompute_threshold`` (the rule of vLLM 0.32's
  NixlConnector: below it P declines the pull itself).  A pull spends one use
  of the entry.
- **D**: the weighted picker over the decode candidates, whose prefix scores
  count D's own prefix cache (from its KV events) and the decode-retained tier,
  so the D holding the conversation is preferred unless its load outweighs it.
- **D alone** (with a :class:`connector.decode_alone.DecodeAloneRule`): the
  tokens left to prefill on each path (:class:`connector.decode_alone.PathTokens`:
  D alone from D's prefix hit, via P with a pull, via P recomputing); when D's
  is small and D is not busy the turn has no P leg (action ``decode_only``,
  counted in ``PlannerStats.decode_alone``): D gets
  :func:`connector.decode_alone.decode_alone_params` (no remote fields; D
  keeps the turn's KV for the next one) and the retained entry is left as it
  is (the guard still runs and is reported).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np

from connector.decode_alone import DecodeAloneRule, PathTokens, decode_alone_params, decode_alone_verdict
from connector.guard import GuardResult, clip_to_prompt
from connector.params import RemoteKVParams, prefill_request_params
from connector.retained import RetainedEntry, RetainedStore
from kvindex.contract import GroupAware
from kvindex.hybrid_score import bound_matches
from kvindex.keys import TokenProcessor
from kvindex.tiers import TierWeights
from scorer.load import LoadSnapshot
from scorer.picker import Choice, WeightedPicker
from scorer.prefix import PrefixIndex, PrefixScore, predicted_cached_tokens, prefix_scores_from_matches, score_prefix

__all__ = ["TurnPlan", "PlannerStats", "PDPlanner", "predicted_pull_tokens"]

PULL = "pull"
RECOMPUTE = "recompute"
DECODE_ONLY = "decode_only"


def predicted_pull_tokens(remote_num_tokens: int, prompt_tokens: int, local_tokens: int) -> int:
    """Tokens P will count as external (loaded from D): ``min(remote_num_tokens, prompt_tokens) - local_tokens`` (>= 0).

    Mirrors vLLM 0.32 NixlConnector's scheduler side
    (vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py,
    ``get_num_new_matched_tokens`` for params with ``do_remote_decode``): the
    remote KV covers up to ``remote_num_tokens``, and P's own prefix-cache hits
    (``local_tokens``) come first.  When the remote KV covers the whole
    prompt, vLLM's scheduler recomputes the last token after the load.
    """
    return max(0, min(remote_num_tokens, prompt_tokens) - local_tokens)


class TurnPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The decisions for one turn.

    Fields:
        conversation_id: the conversation (None: a one-off request).
        prefill_pod, decode_pod: the chosen pods (prefill_pod "" for decode_only).
        action: "pull" (P loads D's retained KV), "recompute", or "decode_only"
            (no P leg: D prefills the request itself, see :meth:`PDPlanner.decode_only`).
        prefill_params: the ``kv_transfer_params`` JSON object for P's request
            (empty for decode_only).
        prompt_tokens: length of the prompt (tokens).
        local_tokens: P's predicted prefix-cache hit (tokens).
        pullable_tokens: tokens the guard left reusable from D (0 if none).
        pulled_tokens: predicted tokens P loads from D (0 for recompute).
        guard: the guard's result (None when there was no entry to check).
        retained_pod: the decode pod holding the entry (None without one).
        reasons: why, one line each.
        prefill_choice, decode_choice: the pickers' explanations (prefill_choice
            None for decode_only).
        fallback: None, or why this plan replaced a failed pull.
        cache_salt: the request's ``cache_salt`` (None: none); every request key
            of the turn (P's and D's prefix scores, the retained entry D's
            answer refreshes) is salted with it, as the engines' block hashes are.
        paths: the tokens left to prefill on each path (None when the planner
            has no decode-alone rule, and for :meth:`PDPlanner.decode_only`).
        decode_params: for a turn D serves alone because of the rule, the
            ``kv_transfer_params`` of D's request
            (:func:`connector.decode_alone.decode_alone_params`); None otherwise
            (the other decode_only turns send D none).
    """

    conversation_id: str | None
    prefill_pod: str
    decode_pod: str
    action: str
    prefill_params: dict
    prompt_tokens: int
    local_tokens: int
    pullable_tokens: int
    pulled_tokens: int
    guard: GuardResult | None
    retained_pod: str | None
    reasons: list[str]
    prefill_choice: Choice | None
    decode_choice: Choice
    fallback: str | None = None
    cache_salt: str | None = None
    paths: PathTokens | None = None
    decode_params: dict | None = None

    def explain(self) -> str:
        """One paragraph: pods, action, token counts and the reasons."""
        head = (
            f"P={self.prefill_pod} D={self.decode_pod} {self.action}: prompt {self.prompt_tokens}, "
            f"local {self.local_tokens}, pullable {self.pullable_tokens}, pulled {self.pulled_tokens}"
        )
        return "\n".join([head] + [f"  - {r}" for r in self.reasons])


class PlannerStats(msgspec.Struct, frozen=True):
    """Counters of a :class:`PDPlanner`.

    turns, pulls; recomputes by reason kind; clipped (guard cut the params);
    fallbacks by cause; retained_stored (entries refreshed from D);
    bad_decode_answers (D params whose block ids do not cover their tokens:
    dropped); decode_only (turns D served without a P leg, all causes);
    decode_alone (those of them the decode-alone rule chose).
    """

    turns: int
    pulls: int
    recomputes: dict[str, int]
    clipped: int
    fallbacks: dict[str, int]
    retained_stored: int
    bad_decode_answers: int
    decode_only: int = 0
    decode_alone: int = 0


class PDPlanner:
    """Plans P/D turns over an index, a retained store and pickers.

    Args:
        index: the shared index (``kvindex.reference.KVBlockIndex``).
        token_processor: turns tokens into request keys (the index's).
        store: the decode-retained store (mirrored into ``index``).
        recompute_threshold: the engines' ``kv_recompute_threshold`` (tokens,
            >= 0; vLLM 0.32's default 64).  Set it from
            :mod:`connector.advisor` and configure the engines alike.
        prefill_picker, decode_picker: pickers (default
            :class:`scorer.picker.WeightedPicker`).
        tier_weights: weights of the tiers in the prefix scores (default
            :class:`kvindex.tiers.TierWeights`: decode_retained 0.7).
        guard: True (default) runs the prompt-extends-retained check; False
            sends D's params unclipped, as routers that trust the client do
            (for comparisons only: it lets P load KV for other tokens).
        model: model name scoping the request keys (as in the KV events).
        decode_alone: conditional disaggregation: a turn whose prefill left on
            D is small, D not busy, skips P
            (:class:`connector.decode_alone.DecodeAloneRule`); None (default):
            every :meth:`plan` has a P leg.

    Raises:
        ValueError: a negative threshold, or a store mirroring into another index.
    """

    def __init__(
        self,
        index: PrefixIndex,
        token_processor: TokenProcessor,
        store: RetainedStore,
        *,
        recompute_threshold: int = 64,
        prefill_picker: WeightedPicker | None = None,
        decode_picker: WeightedPicker | None = None,
        tier_weights: TierWeights | Mapping[str, float] | None = None,
        guard: bool = True,
        model: str | None = None,
        decode_alone: DecodeAloneRule | None = None,
    ) -> None:
        if recompute_threshold < 0:
            raise ValueError(f"recompute_threshold must be >= 0, got {recompute_threshold}")
        if store.index is not None and store.index is not index:
            raise ValueError("the retained store must mirror into the planner's index")
        self.index = index
        self.tp = token_processor
        self.block_size = token_processor.block_size
        self.store = store
        self.recompute_threshold = recompute_threshold
        self.prefill_picker = prefill_picker or WeightedPicker()
        self.decode_picker = decode_picker or WeightedPicker()
        self.weights = TierWeights.of(tier_weights)
        self.guard = guard
        self.model = model
        self.decode_alone_rule = decode_alone
        self._grouped = isinstance(index, GroupAware)  # hybrid models: hits follow the engine's rule
        self._lock = threading.Lock()
        self._turns = 0
        self._pulls = 0
        self._clipped = 0
        self._retained = 0
        self._bad_answers = 0
        self._decode_only = 0
        self._decode_alone = 0
        self._recomputes: Counter[str] = Counter()
        self._fallbacks: Counter[str] = Counter()

    def request_keys(self, tokens: Sequence[int] | np.ndarray, cache_salt: str | None = None) -> np.ndarray:
        """Request keys of ``tokens``' whole blocks (uint64 array), salted with ``cache_salt`` when given."""
        return self.tp.request_keys(tokens, model=self.model, cache_salt=cache_salt or None)

    def _scores(self, keys: np.ndarray, pods: list[str], n_prompt: int) -> dict[str, PrefixScore]:
        """Prefix scores of ``pods``; a hybrid pod's match cut to its engine's hit rule (GroupAware index)."""
        if not self._grouped:
            return score_prefix(self.index, keys, pods, block_size=self.block_size, weights=self.weights)
        matches = self.index.prefix_match(keys, pods) if len(keys) and pods else {}
        if matches:
            matches, _ = bound_matches(self.index, matches, keys, self.block_size, n_prompt, self.model)
        return prefix_scores_from_matches(matches, len(keys), self.block_size, pods, self.weights)

    # ------------------------------------------------------------------ turns

    def plan(
        self,
        conversation_id: str | None,
        prompt_tokens: Sequence[int] | np.ndarray,
        prefill_pods: Sequence[str],
        decode_pods: Sequence[str],
        loads: Mapping[str, LoadSnapshot] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> TurnPlan:
        """Decide one turn (see the module docstring).

        Args:
            conversation_id: None for a request outside any conversation.
            prompt_tokens: the full prompt's token ids (chat template applied).
            prefill_pods, decode_pods: candidates (non-empty).
            loads: pod -> LoadSnapshot (missing pods count as idle).
            cache_salt: the request's ``cache_salt``: the engines salt their
                block hashes with it, so P's local hits and the retained
                tokens are matched under the same salt (a conversation whose
                salt changes finds nothing reusable).

        Raises:
            ValueError: no prefill or no decode candidates.
        """
        if not prefill_pods or not decode_pods:
            raise ValueError("plan needs at least one prefill and one decode pod")
        loads = loads or {}
        tokens = np.asarray(prompt_tokens, dtype=np.int64)
        n_prompt = len(tokens)
        keys = self.request_keys(tokens, cache_salt)
        reasons: list[str] = []
        p_choice, local = self._pick_prefill(keys, n_prompt, prefill_pods, loads, reasons)
        entry = self.store.get(conversation_id) if conversation_id is not None else None
        retained_pod = entry.decode_pod if entry is not None else None
        d_choice, d_local = self._pick_decode(keys, n_prompt, decode_pods, loads, retained_pod, reasons)
        kind, why, remote, guard, pullable = self._retained_decision(
            conversation_id, entry, decode_pods, tokens, keys, local, reasons)
        paths = None
        if self.decode_alone_rule is not None:
            pull = predicted_pull_tokens(pullable, n_prompt, local) if kind is None and remote is not None else 0
            paths = PathTokens(n_prompt - d_local, n_prompt - local - pull, n_prompt - local)
            if self._weigh_paths(paths, loads.get(d_choice.pod), reasons):
                return self._alone_plan(conversation_id, n_prompt, d_choice, guard, pullable, retained_pod, paths,
                                        reasons, cache_salt)
        if kind is None and remote is not None:
            assert conversation_id is not None
            if self.store.take(conversation_id) is None:
                # a shared store (connector.redis_retained): another router replica used it first
                kind, why = "taken", "the retained entry was used meanwhile (by another router)"
                remote = None
        if kind is None and remote is not None:
            pulled = predicted_pull_tokens(pullable, n_prompt, local)
            action, params = PULL, remote.to_dict()
        else:
            pulled = 0
            action, params = RECOMPUTE, prefill_request_params().to_dict()
        self._tally(action, kind)
        reasons.append(f"{action}: {why}")
        return TurnPlan(
            conversation_id=conversation_id,
            prefill_pod=p_choice.pod,
            decode_pod=d_choice.pod,
            action=action,
            prefill_params=params,
            prompt_tokens=n_prompt,
            local_tokens=local,
            pullable_tokens=pullable,
            pulled_tokens=pulled,
            guard=guard,
            retained_pod=retained_pod,
            reasons=reasons,
            prefill_choice=p_choice,
            decode_choice=d_choice,
            cache_salt=cache_salt or None,
            paths=paths,
        )

    def _weigh_paths(self, paths: PathTokens, d_load: LoadSnapshot | None, reasons: list[str]) -> bool:
        """True when the decode-alone rule gives the turn to D alone (the verdict goes into ``reasons``)."""
        assert self.decode_alone_rule is not None
        reasons.append(paths.describe())
        alone, verdict = decode_alone_verdict(self.decode_alone_rule, paths, d_load)
        reasons.append(f"{DECODE_ONLY}: {verdict}" if alone else f"via P: {verdict}")
        return alone

    def _alone_plan(
        self, conversation_id: str | None, n_prompt: int, d_choice: Choice, guard: GuardResult | None, pullable: int,
        retained_pod: str | None, paths: PathTokens, reasons: list[str], cache_salt: str | None,
    ) -> TurnPlan:
        """The turn D serves alone by the decode-alone rule: no P leg, D keeps its KV for the next turn.

        The retained entry is not taken: D's answer replaces it
        (:meth:`decode_answered`), and D's prefix cache serves D's hit anyway.
        """
        with self._lock:
            self._turns += 1
            self._decode_only += 1
            self._decode_alone += 1
        return TurnPlan(
            conversation_id=conversation_id,
            prefill_pod="",
            decode_pod=d_choice.pod,
            action=DECODE_ONLY,
            prefill_params={},
            prompt_tokens=n_prompt,
            local_tokens=0,
            pullable_tokens=pullable,
            pulled_tokens=0,
            guard=guard,
            retained_pod=retained_pod,
            reasons=reasons,
            prefill_choice=None,
            decode_choice=d_choice,
            cache_salt=cache_salt or None,
            paths=paths,
            decode_params=decode_alone_params(),
        )

    def _pick_prefill(
        self, keys: Sequence[int], n_prompt: int, prefill_pods: Sequence[str], loads: Mapping[str, LoadSnapshot],
        reasons: list[str],
    ) -> tuple[Choice, int]:
        """P by prefix and load; (its choice, the prompt tokens it will find in its own prefix cache)."""
        scores = self._scores(keys, list(prefill_pods), n_prompt)
        choice = self.prefill_picker.pick(scores, loads, list(prefill_pods))
        p = choice.pod
        local = predicted_cached_tokens(scores[p].matched_blocks, n_prompt, self.block_size)
        reasons.append(f"P {p}: {choice.explanation[p].reason}; {local} tokens cached locally")
        return choice, local

    def _pick_decode(
        self, keys: Sequence[int], n_prompt: int, decode_pods: Sequence[str], loads: Mapping[str, LoadSnapshot],
        retained_pod: str | None, reasons: list[str],
    ) -> tuple[Choice, int]:
        """D by prefix (the retained tier included) and load; (its choice, the prompt tokens D holds).

        D's retained blocks stay in its prefix cache (vLLM 0.32 keeps them
        hashed while it waits for a pull), so any tier counts for D's hit.
        """
        scores = self._scores(keys, list(decode_pods), n_prompt)
        choice = self.decode_picker.pick(scores, loads, list(decode_pods))
        d = choice.pod
        held = predicted_cached_tokens(scores[d].matched_blocks, n_prompt, self.block_size)
        if retained_pod is not None:
            why = "holds the conversation" if d == retained_pod else f"{retained_pod} holds the conversation but lost"
            reasons.append(f"D {d}: {choice.explanation[d].reason} ({why})")
        else:
            reasons.append(f"D {d}: {choice.explanation[d].reason}")
        return choice, held

    def _retained_decision(
        self, conversation_id: str | None, entry: RetainedEntry | None, decode_pods: Sequence[str],
        tokens: np.ndarray, keys: Sequence[int], local: int, reasons: list[str],
    ) -> tuple[str | None, str, RemoteKVParams | None, GuardResult | None, int]:
        """What D retained for this turn: (recompute kind or None to pull, why, params, guard, pullable tokens)."""
        n_prompt = len(tokens)
        if conversation_id is None:
            return "no_conversation", "no conversation_id: nothing retained to pull", None, None, 0
        if entry is None:
            return "no_entry", "no live retained entry (first turn, expired, used or evicted)", None, None, 0
        if entry.decode_pod not in decode_pods:
            self.store.discard(conversation_id)
            why = f"retained on {entry.decode_pod}, which is no longer a decode candidate"
            return "decode_gone", why, None, None, 0
        guard: GuardResult | None = None
        if self.guard:
            guard = clip_to_prompt(entry.params, entry.tokens, entry.request_keys, tokens, keys, self.block_size)
            remote, pullable = guard.params, guard.reusable_tokens
            if guard.clipped:
                with self._lock:
                    self._clipped += 1
            reasons.append(f"guard: {guard.reason}")
        else:
            remote, pullable = entry.params, entry.num_tokens
            reasons.append("guard off: D's params sent as they are")
        if remote is None:
            self.store.discard(conversation_id)
            return "guard_nothing", "nothing reusable after the guard", None, guard, pullable
        pull = predicted_pull_tokens(pullable, n_prompt, local)
        balance = f"pullable {min(pullable, n_prompt)} - local {local} = {pull}"
        if pull < self.recompute_threshold or pull == 0:
            return "below_threshold", f"{balance} < threshold {self.recompute_threshold}", remote, guard, pullable
        why = f"{balance} >= threshold {self.recompute_threshold}: pull from {entry.decode_pod}"
        return None, why, remote, guard, pullable

    def _tally(self, action: str, kind: str | None) -> None:
        with self._lock:
            if action == PULL:
                self._pulls += 1
            else:
                self._recomputes[kind or "other"] += 1
            self._turns += 1

    def decode_only(
        self,
        conversation_id: str | None,
        prompt_tokens: Sequence[int] | np.ndarray,
        decode_pods: Sequence[str],
        loads: Mapping[str, LoadSnapshot] | None = None,
        *,
        reason: str,
        cache_salt: str | None = None,
    ) -> TurnPlan:
        """A turn D serves alone (no P leg, no params): for requests one P prefill cannot serve.

        ``reason`` says why (see ``examples.router.pd.decode_only_reason``: a
        batch of prompts, ``n`` > 1, prompt logprobs).  D is picked as in
        :meth:`plan` (its own prefix cache and the decode-retained tier count,
        so the D holding the conversation is preferred).  The conversation's
        retained entry is neither used nor dropped: D still holds those blocks,
        and a later turn that extends them can pull them.

        Raises:
            ValueError: no decode candidates.
        """
        if not decode_pods:
            raise ValueError("decode_only needs at least one decode pod")
        tokens = np.asarray(prompt_tokens, dtype=np.int64)
        keys = self.request_keys(tokens, cache_salt)
        d_scores = self._scores(keys, list(decode_pods), len(tokens))
        d_choice = self.decode_picker.pick(d_scores, loads or {}, list(decode_pods))
        d = d_choice.pod
        with self._lock:
            self._turns += 1
            self._decode_only += 1
        return TurnPlan(
            conversation_id=conversation_id,
            prefill_pod="",
            decode_pod=d,
            action=DECODE_ONLY,
            prefill_params={},
            prompt_tokens=len(tokens),
            local_tokens=0,
            pullable_tokens=0,
            pulled_tokens=0,
            guard=None,
            retained_pod=None,
            reasons=[f"D {d}: {d_choice.explanation[d].reason}", f"{DECODE_ONLY}: {reason}"],
            prefill_choice=None,
            decode_choice=d_choice,
            cache_salt=cache_salt or None,
        )

    def fallback(self, plan: TurnPlan, cause: str, *, decode_only: bool = False) -> TurnPlan:
        """The same turn without remote params, after a failed P leg (counted by ``cause``).

        E.g. P answered HTTP 500 because D's entry expired on D's clock
        (NixlConnector's default ``kv_load_failure_policy`` "fail"), or D was
        unreachable: P recomputes.  ``decode_only``: P itself did not answer,
        so the plan's D serves the turn alone (no P leg, as :meth:`decode_only`).
        The retained entry is already spent.
        """
        with self._lock:
            self._fallbacks[cause] += 1
        if decode_only:
            return msgspec.structs.replace(
                plan,
                prefill_pod="",
                action=DECODE_ONLY,
                prefill_params={},
                local_tokens=0,
                pulled_tokens=0,
                fallback=cause,
                reasons=[*plan.reasons, f"fallback to {DECODE_ONLY}: {cause}"],
            )
        return msgspec.structs.replace(
            plan,
            action=RECOMPUTE,
            prefill_params=prefill_request_params().to_dict(),
            pulled_tokens=0,
            fallback=cause,
            reasons=[*plan.reasons, f"fallback to recompute: {cause}"],
        )

    @staticmethod
    def decode_params(prefill_answer: RemoteKVParams | None) -> dict | None:
        """Leg 3: the params for D's request from P's answer (None: P gave none, D computes alone)."""
        if prefill_answer is None or not prefill_answer.do_remote_prefill:
            return None
        return prefill_answer.to_dict()

    def decode_answered(
        self,
        plan: TurnPlan,
        decode_answer: RemoteKVParams | None,
        tokens: Sequence[int] | np.ndarray,
    ) -> RetainedEntry | None:
        """Refresh the conversation's retained entry from D's answer.

        Args:
            plan: this turn's plan (names the conversation and D).
            decode_answer: D's kv_transfer_params (None when D gave none, e.g.
                a streamed answer in vLLM 0.32 or D not bidirectional).
            tokens: prompt token ids followed by the generated token ids; the
                first ``remote_num_tokens`` are the ones D holds.

        Returns:
            The new entry, or None (then any old entry is dropped: D's
            retained blocks of an older turn no longer extend the history).
        """
        cid = plan.conversation_id
        if cid is None:
            return None
        if decode_answer is None or not decode_answer.do_remote_decode:
            self.store.discard(cid)
            return None
        toks = np.asarray(tokens, dtype=np.int64)
        n = decode_answer.remote_num_tokens if decode_answer.remote_num_tokens is not None else len(toks)
        need = -(-n // self.block_size)
        if n > len(toks) or all(len(g) < need for g in decode_answer.remote_block_ids):
            # D's answer does not fit the tokens (no group names every block; a hybrid's
            # sliding-window or Mamba group names only its tail: connector.guard): never keep it
            self.store.discard(cid)
            with self._lock:
                self._bad_answers += 1
            return None
        held = toks[:n]
        entry = self.store.put(cid, plan.decode_pod, decode_answer, held, self.request_keys(held, plan.cache_salt))
        with self._lock:
            self._retained += 1
        return entry

    def stats(self) -> PlannerStats:
        """Counters snapshot (see :class:`PlannerStats`)."""
        with self._lock:
            return PlannerStats(
                turns=self._turns,
                pulls=self._pulls,
                recomputes=dict(self._recomputes),
                clipped=self._clipped,
                fallbacks=dict(self._fallbacks),
                retained_stored=self._retained,
                bad_decode_answers=self._bad_answers,
                decode_only=self._decode_only,
                decode_alone=self._decode_alone,
            )
